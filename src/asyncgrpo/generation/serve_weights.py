"""Reading weights for `asyncgrpo serve`'s reload_weights and deltas: regular files only, never a blocking open.

Job: `read_weights_dir(DIR)` returns every tensor of DIR's ``*.safetensors`` files and the
publisher's version (DIR/asyncgrpo_version.json), or raises an error naming the file;
`read_weights(DIR, timeout_s)` does it on a daemon thread within a deadline (`read_bounded` any such
read: also a delta file's, `read_delta_file`; serve.py checks and applies a delta with weight_delta.py).

Invariants:
- Only regular files are read. Each file is opened with ``O_NONBLOCK`` (opening a FIFO for
  reading would otherwise block until a writer appears) and checked with ``fstat`` on that open
  descriptor (no window between the check and the read): a FIFO, socket or device, directly or
  through a symlink, is refused with ``NotARegularFile`` naming it, before a byte is read.
- The bytes are read by Python (which releases the GIL while it waits) and parsed from memory by
  safetensors: safetensors' own ``load_file`` holds the GIL while its open blocks, which froze the
  whole server on a FIFO, and no deadline in the process could end that. So the caller's deadline
  (`read_weights`: ``--reload-timeout-s``, on a daemon thread that is abandoned at the
  deadline and cannot keep the process from exiting) bounds the whole read. The cost: a file is
  held twice in memory while it is parsed (its bytes and its tensors).
- Weights holding NaN or inf are refused (ValueError naming the tensors).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from asyncgrpo.generation.weight_delta import load_delta
from asyncgrpo.generation.weight_sync import VERSION_FILE
from asyncgrpo.threads import run_in_daemon_thread

T = TypeVar("T")


async def read_weights(directory: Path, timeout_s: float) -> tuple[dict[str, Any], int | None]:
    """`read_weights_dir(directory)` on a daemon thread, abandoned after `timeout_s` (TimeoutError saying so)."""
    return await read_bounded(lambda: read_weights_dir(directory), timeout_s)


async def read_bounded(read: Callable[[], T], timeout_s: float) -> T:
    """`read()` on a daemon thread, abandoned after `timeout_s` (TimeoutError naming --reload-timeout-s)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await run_in_daemon_thread(read, name="asyncgrpo-serve-reload")
    except TimeoutError:
        raise TimeoutError(f"reading the weights did not finish within --reload-timeout-s = {timeout_s:g} s (a slow or "
                           f"hung file system?); the weights being served are unchanged. Fix: check the path's storage, "
                           f"or restart the server with a larger --reload-timeout-s") from None


class NotARegularFile(OSError):
    """A weights path (or a file in it) that is a FIFO, socket, device or directory: never read."""


def read_regular_file(path: Path) -> bytes:
    """The bytes of `path`, which must be a regular file (a symlink to one is fine); raises NotARegularFile otherwise."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{path} is not a regular file (it is a {_kind(mode)}); reload_weights reads only regular files")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read()
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return f"file of mode {stat.filemode(mode)}"


def read_weights_dir(directory: Path) -> tuple[dict[str, Any], int | None]:
    """Every tensor of every *.safetensors file in `directory`, and the publisher's version (None if absent).
    Raises NotARegularFile for a file that is not a regular one, ValueError if any floating-point tensor holds NaN or inf."""
    from safetensors.torch import load

    if not directory.is_dir():
        raise FileNotFoundError(f"weights_path {directory} is not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights_path {directory} holds no .safetensors file")
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(load(read_regular_file(file)))
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not bool(tensor.isfinite().all())]
    if bad:
        raise ValueError(f"{len(bad)} of {len(weights)} tensors hold NaN or inf (e.g. {', '.join(bad[:3])}); refused, "
                         f"the weights being served are unchanged. Check the trainer (learning rate, loss scale) that "
                         f"produced them")
    marker = read_marker(directory)
    return weights, None if marker is None else int(marker["version"])


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The publisher's VERSION_FILE in `directory` (``version``, and ``weights_id`` from the delta publisher), or None."""
    marker = directory / VERSION_FILE
    if not os.path.lexists(marker):
        return None
    return dict(json.loads(read_regular_file(marker)))


def read_delta_file(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Entries and manifest of a delta file (a regular file only); DeltaError if it is not one."""
    return load_delta(read_regular_file(path))
