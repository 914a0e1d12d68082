"""Weight deltas: the elements of a state dict that changed since a base, and a checksum of the whole result.

Job: `encode_delta(base, new)` gives the entries that turn `base` into `new` (None when that would not be
smaller than `new` itself); `apply_delta(current, entries)` computes the changed tensors from them, `merge_delta` the whole
state a server installs after checking the base and the checksum;
`checksum(state)` fingerprints a whole state; `save_delta` / `load_delta` put entries and their manifest
in one file. Used by the publisher (delta_publisher.py), `asyncgrpo serve` (serve_weights.py) and the vLLM
worker extension (vllm_weights.py), which runs in vLLM's interpreter: this module imports only torch,
numpy, safetensors and the standard library.

Invariants:
- Comparison and checksum are bitwise (elements compared as integers of their width): -0.0 and 0.0
  differ, a NaN equals itself bit for bit; `apply_delta(base, encode_delta(base, new))` is `new` exactly.
- Per tensor the smaller encoding is kept: ``index`` (int32 positions + values, for few changes),
  ``mask`` (one bit per element + values) or ``full`` (the tensor; also for a new name, shape or dtype).
  A base whose names differ from `new`'s, or a delta whose bytes reach `new`'s, gives None (full copy).
- `checksum` covers names, dtypes, shapes and bytes of every tensor in name order (CRC-32: it detects
  a wrong base, a torn or truncated application; it is no defence against tampering).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4  # int32 positions: tensors of up to 2**31 elements


@dataclass(frozen=True)
class Delta:
    """Entries (safetensors-ready: ``full/NAME``, ``index/NAME``, ``mask/NAME``, ``values/NAME``) and their bytes."""

    entries: dict[str, torch.Tensor]
    nbytes: int
    changed: int  # elements that differ from the base
    total: int  # elements of the new state


class DeltaError(ValueError):
    """A delta that cannot be applied to what the server holds (a wrong shape, a missing name, a bad file)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> Delta | None:
    """The entries turning `base` into `new` (CPU tensors), or None when a full copy is no larger (see module docstring)."""
    if set(base) != set(new):
        return None
    full_bytes = state_nbytes(new)
    entries: dict[str, torch.Tensor] = {}
    nbytes = changed = 0
    for name in sorted(new):
        t, b = new[name], base[name]
        n, width = t.numel(), t.element_size()
        if b.shape != t.shape or b.dtype != t.dtype:
            entries[f"full/{name}"] = t.contiguous()
            nbytes, changed = nbytes + n * width, changed + n
            continue
        new_bits = _bits(t).numpy()
        diff = new_bits != _bits(b).numpy()
        positions = np.flatnonzero(diff)  # numpy: an order of magnitude faster than torch's boolean indexing on CPU
        k = int(positions.size)
        if k == 0:
            continue
        costs = {"index": k * (_INDEX_BYTES + width), "mask": (n + 7) // 8 + k * width, "full": n * width}
        kind = min(costs, key=lambda key: costs[key])
        if kind == "full":
            entries[f"full/{name}"] = t.contiguous()
        else:
            entries[f"{kind}/{name}"] = torch.from_numpy(positions.astype(np.int32) if kind == "index" else np.packbits(diff))
            entries[f"values/{name}"] = torch.from_numpy(new_bits[positions]).view(t.dtype)
        nbytes, changed = nbytes + costs[kind], changed + k
        if nbytes >= full_bytes:
            return None
    return Delta(entries, nbytes, changed, sum(t.numel() for t in new.values()))


def apply_delta(current: Mapping[str, torch.Tensor], entries: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new tensors of every name the entries change, computed from `current` (left untouched), in the entries'
    dtypes. Raises DeltaError for a name `current` lacks or an entry that does not fit its tensor."""
    out: dict[str, torch.Tensor] = {}
    for key, value in entries.items():
        kind, _, name = key.partition("/")
        if kind == "values":
            continue
        if kind not in ("full", "index", "mask"):
            raise DeltaError(f"unknown delta entry {key!r} (expected full/, index/, mask/ or values/)")
        if name not in current:
            raise DeltaError(f"the delta changes {name!r}, which the weights being served do not have")
        if kind == "full":
            if tuple(value.shape) != tuple(current[name].shape):
                raise DeltaError(f"the delta's {name!r} has shape {tuple(value.shape)}, the served one "
                                 f"{tuple(current[name].shape)}")
            out[name] = value
            continue
        values = entries.get(f"values/{name}")
        if values is None:
            raise DeltaError(f"the delta has {key!r} but no 'values/{name}'")
        base = current[name]
        flat = base.detach().reshape(-1).to(values.dtype, copy=True)
        n = flat.numel()
        if kind == "index":
            positions = value.numpy().astype(np.int64)
            if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= n):
                raise DeltaError(f"the delta's positions for {name!r} do not fit its {n} elements")
        else:
            if value.numel() != (n + 7) // 8:
                raise DeltaError(f"the delta's mask for {name!r} has {value.numel()} bytes, its {n} elements need {(n + 7) // 8}")
            positions = np.flatnonzero(np.unpackbits(value.numpy(), count=n).view(bool))
        if positions.size != values.numel():
            raise DeltaError(f"the delta has {values.numel()} values for {positions.size} changed elements of {name!r}")
        _bits(flat).numpy()[positions] = _bits(values).numpy()
        out[name] = flat.reshape(base.shape)
    return out


def merge_delta(current: Mapping[str, Any], held_id: str | None, entries: Mapping[str, Any],
                manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The full state after applying the delta to `current` (the served weights, identified by `held_id`): every name
    of the manifest, changed tensors new, the others `current`'s own. Raises DeltaError when the delta is against
    another base, does not fit, or the result's checksum is not the publisher's (nothing is changed then)."""
    if manifest["base"] != held_id:
        raise DeltaError(f"the delta is against weights {manifest['base']}, this server holds "
                         f"{held_id or 'weights of no asyncgrpo version'}")
    dtypes = manifest["dtypes"]
    missing = [name for name in dtypes if name not in current]
    if missing:
        raise DeltaError(f"the delta names weights this server does not have: {missing[:3]}")
    changed = apply_delta(current, entries)
    merged = {name: changed.get(name, current[name]) for name in dtypes}
    got = checksum(merged, dtypes)
    if got != manifest["checksum"]:
        raise DeltaError(f"the weights after the delta have checksum {got}, the publisher's have {manifest['checksum']}")
    return merged


def checksum(state: Mapping[str, torch.Tensor], dtypes: Mapping[str, str] | None = None) -> str:
    """CRC-32 of every tensor (name, dtype, shape, bytes) in name order; `dtypes` (name -> torch dtype name, e.g.
    ``"bfloat16"``) casts first, so a server that keeps the weights in a wider dtype checks what was published."""
    crc = 0
    for name in sorted(state):
        t = state[name].detach()
        if dtypes is not None and name in dtypes and str(t.dtype).removeprefix("torch.") != dtypes[name]:
            t = t.to(getattr(torch, dtypes[name]))
        t = t.to("cpu").contiguous()
        header = f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}".encode()
        crc = zlib.crc32(header, crc)
        if t.numel():
            crc = zlib.crc32(_bits(t).numpy().view(np.uint8).data, crc)
    return f"{crc:08x}"


def dtype_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: str(t.dtype).removeprefix("torch.") for name, t in state.items()}


def save_delta(path: Path, delta: Delta, manifest: Mapping[str, Any]) -> None:
    """One safetensors file (any name; the manifest rides in its metadata as JSON under ``asyncgrpo``)."""
    from safetensors.torch import save_file

    save_file(dict(delta.entries), str(path), metadata={"format": "pt", "asyncgrpo": json.dumps(dict(manifest))})


def load_delta(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Entries and manifest of a file written by `save_delta` (its bytes); DeltaError if it is not one."""
    from safetensors.torch import load

    try:
        entries = load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        manifest = json.loads(meta["asyncgrpo"])
    except Exception as exc:  # noqa: BLE001 - any malformed file is one error: not a delta
        raise DeltaError(f"not an asyncgrpo weight delta ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or not {"base", "weights_id", "checksum", "dtypes"} <= set(manifest):
        raise DeltaError(f"the delta's manifest lacks base, weights_id, checksum or dtypes: {manifest!r}")
    return entries, manifest
