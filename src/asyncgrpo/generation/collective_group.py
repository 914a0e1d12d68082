"""The collective transport of `generation.http.weight_sync: nccl`: a two-party process group and its wire format.

Job: everything both ends of a collective weight transfer share, with torch alone (no vLLM), so that the
trainer (collective_publisher.py), vLLM's worker (collective_vllm.py) and any other engine speak exactly the
same protocol:

- `open_group(...)`: one process group per server (the trainer at rank 0, the server's worker at rank 1),
  formed over a TCPStore rendezvous at ``master_address:master_port``: gloo (CPU tensors) or NCCL (CUDA
  tensors) of torch.distributed, created directly, so neither side touches a default process group;
- `FlatWeights`: a state dict as one flat byte buffer plus its layout (`TensorMeta`: name, dtype, shape,
  offset), so a version crosses the wire in a few broadcasts of at most `chunk_bytes` whatever its number
  of tensors, and any dtype (bf16 included) travels as bytes;
- `send(group, flat)` / `receive(group, metas, chunk_bytes, device)`: the broadcasts from rank 0.

Invariants:
- Both ends derive the chunking from the same layout (the metadata the trainer sends before the data),
  so they cut the stream identically; `layout` aligns every tensor to `ALIGN` bytes, so each is a view of
  the buffer in its own dtype.
- Every blocking call is bounded by the group's `timeout` (the store's rendezvous and every collective):
  a peer that died or stopped answering raises here, it never blocks forever; callers on an event loop
  run these calls on a thread they can abandon (collective_thread.py) and keep their own deadline too.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # bytes: each tensor starts at a multiple, so it is a well-aligned view of the flat buffer
DEFAULT_CHUNK_BYTES = 64 * 2**20
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class FlatWeights:
    """A state dict as one contiguous uint8 buffer (`data`) and its layout."""

    data: torch.Tensor
    metas: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


def layout(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[tuple[TensorMeta, ...], int]:
    """Offsets for (name, dtype, shape) entries in order; returns the metas and the total size in bytes."""
    metas, offset = [], 0
    for name, dtype, shape in entries:
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which is not a torch dtype")
        meta = TensorMeta(name, dtype, tuple(int(s) for s in shape), offset)
        metas.append(meta)
        offset += -(-meta.nbytes // ALIGN) * ALIGN
    return tuple(metas), offset


def flatten(state: Mapping[str, torch.Tensor], device: str | torch.device = "cpu") -> FlatWeights:
    """Copy `state` into one new buffer on `device` (the copy is the trainer's staged version: training may go on)."""
    metas, total = layout([(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()])
    data = torch.zeros(total, dtype=torch.uint8, device=device)
    for meta in metas:
        view(data, meta).copy_(state[meta.name].detach())
    return FlatWeights(data, metas)


def view(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor `meta` describes, as a view of the flat buffer `data`."""
    return data[meta.offset: meta.offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)


def unflatten(flat: FlatWeights) -> dict[str, torch.Tensor]:
    return {meta.name: view(flat.data, meta) for meta in flat.metas}


def chunks(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return [(start, min(total, start + chunk_bytes)) for start in range(0, total, chunk_bytes)]


def open_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float, *, store: Any = None) -> Any:
    """Join the group at ``master_address:master_port`` as `rank` (blocks until every rank joined, or `timeout_s`).

    Rank 0 passes the master `store` it created (`master_store`, so it knows the port before the others join)."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"collective backend {backend!r} is not one of {', '.join(BACKENDS)}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size=world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore("asyncgrpo-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def master_store(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's TCPStore on a free port of `host` (its `.port`), not waiting for the others yet."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size=world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def send(group: Any, flat: FlatWeights, chunk_bytes: int) -> None:
    """Broadcast `flat` from rank 0, chunk by chunk; returns once every chunk went out (or raises)."""
    for start, end in chunks(flat.nbytes, chunk_bytes):
        group.broadcast(flat.data[start:end], 0).wait()
    if flat.data.is_cuda:
        torch.cuda.current_stream().synchronize()


def receive(group: Any, metas: tuple[TensorMeta, ...], total: int, chunk_bytes: int,
            device: str | torch.device = "cpu") -> FlatWeights:
    """Receive what `send` broadcasts with that layout, into a new buffer on `device`."""
    data = torch.empty(total, dtype=torch.uint8, device=device)
    for start, end in chunks(total, chunk_bytes):
        group.broadcast(data[start:end], 0).wait()
    if data.is_cuda:
        torch.cuda.current_stream().synchronize()
    return FlatWeights(data, metas)


def update_info(flat: FlatWeights, chunk_bytes: int, version: int) -> dict[str, Any]:
    """The metadata the trainer sends a server before the data (vLLM's /update_weights ``update_info``)."""
    return {"names": [m.name for m in flat.metas], "dtype_names": [m.dtype for m in flat.metas],
            "shapes": [list(m.shape) for m in flat.metas], "total_bytes": flat.nbytes, "chunk_bytes": chunk_bytes,
            "version": version}


def parse_update_info(info: Mapping[str, Any]) -> tuple[tuple[TensorMeta, ...], int, int]:
    """(metas, total bytes, chunk bytes) from `update_info`'s dict; ValueError naming what is wrong."""
    try:
        names, dtypes, shapes = list(info["names"]), list(info["dtype_names"]), list(info["shapes"])
        total, chunk_bytes = int(info["total_bytes"]), int(info["chunk_bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"update_info lacks or has a bad {exc}: it needs names, dtype_names, shapes, total_bytes "
                         f"and chunk_bytes (asyncgrpo.generation.collective_group.update_info)") from exc
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_info has {len(names)} names, {len(dtypes)} dtype_names and {len(shapes)} shapes")
    metas, expected = layout([(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)])
    if expected != total:
        raise ValueError(f"update_info says {total} bytes, its layout needs {expected}: trainer and server disagree "
                         f"on the wire format (run the same asyncgrpo on both)")
    return metas, total, chunk_bytes
