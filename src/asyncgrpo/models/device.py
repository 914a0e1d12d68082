"""Where tensors live and in what dtype they are computed: `train.device`, `generation.local.device`, `train.precision`.

Job: turn the config's device and precision strings into torch objects, with one clear error
when the machine cannot honour them (no silent fall-back to the CPU: a run that asked for a GPU
and trains on the CPU is hours slower and says nothing).

Invariants:
- `resolve_device("auto")` is cuda when available, else mps, else cpu; an explicit device that
  is not available raises `ConfigError` naming the key, the value and the fix.
- `check_precision` refuses bfloat16 on a GPU without it before any step runs.
- `autocast(device, "float32")` is a no-op context; bfloat16/float16 run under `torch.autocast`
  on the device's type, so matmuls run in the low-precision dtype while parameters stay float32.
  Its cast cache is off: each weight is used once per forward, so the cache saved no cast but held
  a low-precision copy of every weight until the forward ended (2 bytes/parameter at bfloat16 that
  gradient checkpointing could not free; docs/benchmarks.md, "Memory per parameter").
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from asyncgrpo.errors import ConfigError

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str, *, key: str = "train.device") -> torch.device:
    """The torch device of `spec` (auto, cpu, cuda, cuda:N, mps); ConfigError if this machine has none such."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (or a CPU-only torch build)"
            raise ConfigError(
                f"{key} = {spec!r}, but this machine has {have}. Fix: set {key}: auto (uses an accelerator when "
                f"present) or cpu, or install a CUDA build of torch on a machine with a GPU."
            )
    if device.type == "mps" and not _mps_available():
        raise ConfigError(f"{key} = {spec!r}, but MPS is not available here. Fix: set {key}: auto or cpu.")
    return device


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def check_precision(device: torch.device, precision: str) -> None:
    """ConfigError when `device` cannot compute in `precision` natively: bfloat16 needs a GPU of compute capability 8.0
    or newer; on older ones (V100, T4) torch emulates it, several times slower than float16."""
    if precision == "bfloat16" and device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < (8, 0):
        raise ConfigError(
            f"train.precision = 'bfloat16', but the GPU of train.device ({device}, compute capability "
            f"{capability[0]}.{capability[1]}) has no native bfloat16 (it needs 8.0 or newer; torch would emulate it, "
            f"several times slower). Fix: set train.precision: float16 (trained with a gradient scaler) or float32."
        )


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast to `precision` on `device` (a no-op for float32)."""
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision], cache_enabled=False)
