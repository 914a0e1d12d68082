"""Hand the memory of a training step's freed tensors back to the operating system (glibc's `malloc_trim`).

Job: after each CPU training step, release the free pages glibc's heap keeps. glibc serves the
step's activations, autocast copies and gradients (up to its dynamic mmap threshold, 32 MiB) from
its heap and keeps their pages when they are freed, so without this the process's resident memory
grows by 40-90 MB a step on SmolLM2-135M and the next step starts from there (docs/benchmarks.md,
"Memory per parameter"). `malloc_trim(0)` returns every whole free page (about 0.1 s a step there).

Invariants: no effect and no error where the C library has no `malloc_trim` (macOS, musl, Windows);
it frees nothing that is in use, so it changes no value.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system; True if the C library could (glibc), False where it has no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
