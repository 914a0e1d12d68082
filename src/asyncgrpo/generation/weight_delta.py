"""Weight deltas: the elements of a state dict that changed since a base, and a checksum of the whole result.

Job: `encode_delta(base, new)` gives the entries that turn `base` into `new` (None when that would not be
smaller than `new` itself); `prepare_delta(current, held_id, entries, manifest)` checks a delta against the
weights a server holds and decodes it into `Patches` (nothing written yet), which `Patches.apply(targets)` writes
into those very tensors, in place, and verifies; `checksum(state)` fingerprints a whole state; `save_delta` /
`load_delta` put entries and their manifest in one file. Used by the publisher (delta_publisher.py), `asyncgrpo
serve` (serve.py, on its engine's thread between decoding steps) and the vLLM worker extension (vllm_weights.py,
on its own copy), which runs in vLLM's interpreter: this module imports only torch, numpy, safetensors and the
standard library.

Invariants:
- Comparison and checksum are bitwise (elements compared as integers of their width): -0.0 and 0.0
  differ, a NaN equals itself bit for bit; applying `encode_delta(base, new)` to `base` gives `new` exactly.
- Per tensor the smallest encoding is kept: ``index`` (int32 positions + values, for few changes), ``gaps``
  (one byte per changed element: the distance from the previous one, 1-255, a 0 standing for a skip of 255
  without a change; + values) or ``full`` (the tensor; also for a new name, shape or dtype). The server decodes
  positions from either with work proportional to the changes, never to the tensor. A base whose names differ
  from `new`'s, or a delta whose bytes reach `new`'s, gives None (full copy). The manifest's ``format``
  (FORMAT) must be this module's: a delta written by another one is refused, and the publisher sends the full
  weights.
- Everything that can be wrong with a delta (its base, format, names, shapes, positions, counts) is found by
  `prepare_delta` before a byte of the served weights is written. `Patches.apply` then writes the changed
  elements, computes the checksum of every tensor the manifest names as they now are, and when it is not the
  publisher's (a base that drifted, a corrupted delta) writes the previous elements back (saved before
  each write, restored in reverse order, so tied tensors end as they were) and raises DeltaError: the
  tensors are then bit for bit what they were. An exception during the writes restores them the same way.
- `checksum` covers names, dtypes, shapes and bytes of every tensor in name order (CRC-32: it detects
  a wrong base, a torn or truncated application; it is no defence against tampering).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 2  # of the delta file: 2 = index / gaps / full entries (1 had bit masks)
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX_BYTES = 4  # int32 positions: tensors of up to 2**31 elements
_GAP_MAX = 255  # one byte per gap; a 0 is a skip of this many elements


@dataclass(frozen=True)
class Delta:
    """Entries (safetensors-ready: ``full/NAME``, ``index/NAME``, ``gaps/NAME``, ``values/NAME``) and their bytes;
    `aliases` (name -> the earlier name whose tensor it is, in `new` and in the base) have no entries of their own."""

    entries: dict[str, torch.Tensor]
    nbytes: int
    changed: int  # elements that differ from the base
    total: int  # elements of the new state
    aliases: dict[str, str] = field(default_factory=dict)
    positions: dict[str, np.ndarray | None] = field(default_factory=dict, repr=False)  # per changed name; None: whole

    def apply_to(self, base: dict[str, torch.Tensor]) -> None:
        """Make `base` (the state this delta was encoded against, owned by the caller) equal the new state bit for
        bit: the changed elements written in place, a tensor sent whole replaced by a copy (its aliases with it)."""
        for name, positions in self.positions.items():
            if positions is None:
                base[name] = self.entries[f"full/{name}"].clone()
            else:
                _bits(base[name]).numpy()[positions] = _bits(self.entries[f"values/{name}"]).numpy()
        for name, source in self.aliases.items():
            base[name] = base[source]


class DeltaError(ValueError):
    """A delta that cannot be applied to what the server holds (a wrong shape, a missing name, a bad file)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def state_nbytes(state: Mapping[Any, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device


def copy_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state` in which names that share a tensor (tied weights) share its copy."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if _identity(t) not in copies:
            copies[_identity(t)] = t.detach().clone()
        out[name] = copies[_identity(t)]
    return out


def encode_gaps(positions: np.ndarray) -> np.ndarray:
    """Strictly increasing positions (int64) as ``gaps`` codes: each position's distance from the previous one
    (the first from -1), a distance over 255 preceded by one 0 per 255 skipped."""
    gaps, over, skips = _gaps(positions)
    return _gap_codes(gaps, over, skips)


def _gaps(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distances, the indices of those over 255, and how many skips each of those needs."""
    gaps = np.diff(positions, prepend=-1)
    over = np.flatnonzero(gaps > _GAP_MAX)
    return gaps, over, (gaps[over] - 1) // _GAP_MAX


def _gap_codes(gaps: np.ndarray, over: np.ndarray, skips: np.ndarray) -> np.ndarray:
    if not over.size:
        return gaps.astype(np.uint8)
    rest = gaps.copy()
    rest[over] -= _GAP_MAX * skips
    return np.insert(rest.astype(np.uint8), np.repeat(over, skips), 0)


def decode_gaps(codes: np.ndarray) -> np.ndarray:
    """The positions (int64) that `encode_gaps` encoded as `codes`."""
    steps = codes.astype(np.int64)
    skips = np.flatnonzero(codes == 0)
    if not skips.size:
        return np.cumsum(steps) - 1
    steps[skips] = _GAP_MAX
    return np.delete(np.cumsum(steps) - 1, skips)


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> Delta | None:
    """The entries turning `base` into `new` (CPU tensors), or None when a full copy is no larger (see module docstring).
    A name whose tensor is an earlier name's in `new` and in `base` alike (a tied LM head) is encoded once."""
    if set(base) != set(new):
        return None
    full_bytes = state_nbytes({_identity(t): t for t in new.values()})  # a tied tensor once, as in the delta
    entries: dict[str, torch.Tensor] = {}
    changes: dict[str, np.ndarray | None] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], tuple[str, int]] = {}  # (new's identity, base's identity) -> first name, changed
    nbytes = changed = 0
    for name in sorted(new):
        t, b = new[name], base[name]
        n, width = t.numel(), t.element_size()
        seen = first.get((_identity(t), _identity(b)))
        if seen is not None:
            aliases[name] = seen[0]
            changed += seen[1]
            continue
        if b.shape != t.shape or b.dtype != t.dtype:
            entries[f"full/{name}"], changes[name] = t.contiguous(), None
            nbytes, changed = nbytes + n * width, changed + n
            first[(_identity(t), _identity(b))] = (name, n)
            continue
        new_bits = _bits(t).numpy()
        positions = np.flatnonzero(new_bits != _bits(b).numpy())  # numpy: far faster than torch's boolean indexing on CPU
        k = int(positions.size)
        first[(_identity(t), _identity(b))] = (name, k)
        if k == 0:
            continue
        gaps, over, skips = _gaps(positions)
        costs = {"index": k * (_INDEX_BYTES + width), "gaps": k + int(skips.sum()) + k * width, "full": n * width}
        kind = min(costs, key=lambda key: costs[key])
        if kind == "full":
            entries[f"full/{name}"], changes[name] = t.contiguous(), None
        else:
            codes = positions.astype(np.int32) if kind == "index" else _gap_codes(gaps, over, skips)
            entries[f"{kind}/{name}"] = torch.from_numpy(codes)
            entries[f"values/{name}"], changes[name] = torch.from_numpy(new_bits[positions]).view(t.dtype), positions
        nbytes, changed = nbytes + costs[kind], changed + k
        if nbytes >= full_bytes:
            return None
    return Delta(entries, nbytes, changed, sum(t.numel() for t in new.values()), aliases, changes)


@dataclass(frozen=True)
class _Patch:
    name: str
    positions: np.ndarray | None  # None: the whole tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Patches:
    """A delta checked against the weights it is for and decoded (`prepare_delta`); `apply` writes it."""

    patches: list[_Patch]
    dtypes: dict[str, str]  # the manifest's: every published name and its dtype, which the checksum covers
    expected: str  # the publisher's checksum of the result

    @property
    def names(self) -> list[str]:
        """The names of the tensors the delta changes, in the order written."""
        return [p.name for p in self.patches]

    def apply(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Write the delta into `targets` (the tensors `prepare_delta` checked it against; CPU, contiguous) in place and
        verify the checksum of the result; on a mismatch (DeltaError) or any exception every element written is
        restored first (module docstring)."""
        undo: list[tuple[torch.Tensor, np.ndarray | None, np.ndarray]] = []
        try:
            with torch.no_grad():
                for patch in self.patches:
                    target = targets[patch.name]
                    bits = _bits(target).numpy()
                    new = _bits(patch.values.to(target.dtype)).numpy()
                    if patch.positions is None:
                        undo.append((target, None, bits.copy()))
                        bits[:] = new
                    else:
                        undo.append((target, patch.positions, bits[patch.positions]))
                        bits[patch.positions] = new
            got = checksum({name: targets[name] for name in self.dtypes}, self.dtypes)
            if got != self.expected:
                raise DeltaError(f"the weights after the delta have checksum {got}, the publisher's have {self.expected}; "
                                 f"the {len(undo)} tensors it changed were restored")
        except BaseException:
            for target, positions, old in reversed(undo):
                bits = _bits(target).numpy()
                if positions is None:
                    bits[:] = old
                else:
                    bits[positions] = old
            raise


def prepare_delta(current: Mapping[str, Any], held_id: str | None, entries: Mapping[str, torch.Tensor],
                  manifest: Mapping[str, Any]) -> Patches:
    """The delta decoded for `current` (the served tensors, identified by `held_id`; only their names, shapes and
    layout are read). Raises DeltaError when it is of another format, against another base, names a tensor `current`
    lacks or does not fit one."""
    if manifest.get("format") != FORMAT:
        raise DeltaError(f"the delta is of format {manifest.get('format')!r}, this reader takes format {FORMAT} "
                         f"(a publisher of another asyncgrpo version?)")
    if manifest["base"] != held_id:
        raise DeltaError(f"the delta is against weights {manifest['base']}, this server holds "
                         f"{held_id or 'weights of no asyncgrpo version'}")
    dtypes = dict(manifest["dtypes"])
    missing = [name for name in dtypes if name not in current]
    if missing:
        raise DeltaError(f"the delta names weights this server does not have: {missing[:3]}")
    patches = []
    for key, value in entries.items():
        kind, _, name = key.partition("/")
        if kind == "values":
            continue
        if kind not in ("full", "index", "gaps"):
            raise DeltaError(f"unknown delta entry {key!r} (expected full/, index/, gaps/ or values/)")
        if name not in current:
            raise DeltaError(f"the delta changes {name!r}, which the weights being served do not have")
        target = current[name]
        if target.device.type != "cpu" or not target.is_contiguous():
            raise DeltaError(f"the served {name!r} is not a contiguous CPU tensor; a delta is applied only to those")
        if kind == "full":
            if tuple(value.shape) != tuple(target.shape):
                raise DeltaError(f"the delta's {name!r} has shape {tuple(value.shape)}, the served one {tuple(target.shape)}")
            patches.append(_Patch(name, None, value.reshape(-1)))
            continue
        values = entries.get(f"values/{name}")
        if values is None:
            raise DeltaError(f"the delta has {key!r} but no 'values/{name}'")
        positions = value.numpy().astype(np.int64) if kind == "index" else decode_gaps(value.numpy())
        n = target.numel()
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= n):
            raise DeltaError(f"the delta's positions for {name!r} do not fit its {n} elements")
        if positions.size != values.numel():
            raise DeltaError(f"the delta has {values.numel()} values for {positions.size} changed elements of {name!r}")
        patches.append(_Patch(name, positions, values.reshape(-1)))
    by_name = {patch.name: patch for patch in patches}
    for name, source in dict(manifest.get("aliases") or {}).items():  # written with their source, unless served as one
        if source not in by_name or current.get(name) is current.get(source):
            continue
        if name not in current or tuple(current[name].shape) != tuple(current[source].shape):
            raise DeltaError(f"the delta's {name!r} is {source!r}, which the served {name!r} does not fit")
        patches.append(_Patch(name, by_name[source].positions, by_name[source].values))
    return Patches(patches, dtypes, manifest["checksum"])


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
