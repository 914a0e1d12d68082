"""A sharded trainer's optimizer state in a checkpoint (`train.sharding: fsdp`): each rank writes its own shards.

Job: write the per-parameter optimizer state (AdamW's `step`, `exp_avg`, `exp_avg_sq`, in their own dtype: float32,
or bfloat16 with `train.optimizer_state_dtype: bfloat16`; with LoRA the adapters' only) as
torch.distributed.checkpoint (DCP) files, keyed by parameter name, and read it back at any world size, sharded
(each rank its own shards) or not (whole). No rank gathers another rank's shards: writing them adds almost nothing to the shards a
rank holds anyway (8 / N bytes per parameter with float32 moments), where gathering added the whole state to rank 0
(8; bench/checkpoint_memory.py, docs/benchmarks.md).

Layout, in the checkpoint directory:
- `optimizer/`: DCP's files, one per rank (`__R_0.distcp`), and `.metadata` (written by rank 0 once every rank's
  writes returned: DCP gathers their results, which is the barrier, bounded by the process group's timeout,
  `ray.trainer_timeout_s`), then `manifest.json` (integrity.py `OPTIMIZER_MANIFEST`), written by rank 0 last: every
  file that holds state (a rank with none writes an empty one) and `.metadata`, with its size, each checked as rank 0
  sees it. The manifest is the sharded state's commit point: without it, or with a file of another size, the state
  is not whole (integrity.py `sharded_optimizer_problem`), and the driver
  renames the checkpoint into place only after every rank answered (training/checkpoint.py).
- `trainer_state.pt`'s `optimizer` entry (rank 0's): the optimizer's `state_dict()` without its `state` (the param
  groups; Bf16StateAdamW's rounding generators, rank 0's), the parameter names of each group, and `sharded` (the
  directory's name), where an unsharded trainer's entry holds the `state` itself.

Invariants:
- Every rank must see the checkpoint directory (the driver made it): on several nodes the run directory must be on a
  file system they share. A rank that does not see it is named by every rank before any write (one collective), so
  none waits for it; a file rank 0 does not see after the writes fails the save, naming the file.
- Reading: `read_shards` (the ranks of a sharded trainer, together, once joined: a Ray rank's resume) reads each
  rank's own shards at its world size, whatever the saving one was (DCP reads the chunks each shard overlaps), in
  the optimizer's own moment dtype; `read_full` (one process, a DDP rank; no process group) reads the whole state
  into the unsharded optimizer's `state_dict()` layout. The parameter names must be the loading trainer's.
"""

from __future__ import annotations

import json
import warnings
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncgrpo.errors import DiskError
from asyncgrpo.training.data_parallel import RankShare
from asyncgrpo.training.integrity import OPTIMIZER_DIR, OPTIMIZER_MANIFEST, TRAINER_STATE_FILE, sharded_optimizer_problem

_SEP = "/"  # between a parameter's name (dotted, never a slash) and its state's key


def parameter_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The name in `model` of each parameter of each of `optimizer`'s param groups."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def save(optimizer: torch.optim.Optimizer, model: torch.nn.Module, checkpoint: Path, share: RankShare) -> dict[str, Any]:
    """Every rank, together: this rank's shards of `optimizer`'s state into `checkpoint`/optimizer/, then (rank 0) the
    manifest. Returns the `optimizer` entry of trainer_state.pt (no tensor of the state)."""
    import torch.distributed.checkpoint as dcp

    _check_every_rank_sees(checkpoint, share)
    names = {id(p): name for name, p in model.named_parameters()}
    state = {f"{names[id(p)]}{_SEP}{key}": value for p, entry in optimizer.state.items() for key, value in entry.items()}
    directory = checkpoint / OPTIMIZER_DIR
    try:
        metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
    except dcp.api.CheckpointException as exc:  # a BaseException: one rank's failure, raised on every rank
        failed = "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in sorted(exc.failures.items()))
        raise DiskError(f"trainer rank(s) {', '.join(map(str, sorted(exc.failures)))} of {share.world_size} could not write "
                        f"their shards of the optimizer state into {directory} ({failed}). Fix: see the error (free space, "
                        f"permissions of run.output_dir); the run resumes from its newest checkpoint.") from None
    if share.rank == 0:
        _write_manifest(directory, metadata, share.world_size)
    entry = {key: value for key, value in optimizer.state_dict().items() if key != "state"}
    return {**entry, "names": parameter_names(optimizer, model), "sharded": OPTIMIZER_DIR}


def read_full(checkpoint: Path, entry: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """The whole optimizer state that `save` wrote into `checkpoint` (its trainer_state.pt `entry`), in the layout of
    an unsharded `optimizer.state_dict()`; ValueError when it is not whole or names other parameters than `model`'s."""
    import torch.distributed.checkpoint as dcp

    reader = _reader(checkpoint, entry, optimizer, model)
    template = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in _saved(checkpoint, reader)}
    with warnings.catch_warnings():  # that it reads in one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    index = {name: i for i, name in enumerate(chain(*entry["names"]))}
    state: dict[int, dict[str, Any]] = {}
    for key, value in template.items():
        name, field = key.rsplit(_SEP, 1)
        state.setdefault(index[name], {})[field] = value
    return {**without_tensors(entry), "state": state}


def without_tensors(entry: dict[str, Any]) -> dict[str, Any]:
    """trainer_state.pt's `entry` as an optimizer `state_dict()` whose state is empty (param groups and the rest)."""
    return {**{k: v for k, v in entry.items() if k not in ("names", "sharded")}, "state": {}}


def read_shards(checkpoint: Path, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Every rank of a sharded trainer, together (after `load_checkpoint(..., shards_after_join=True)` and joining):
    this rank's shards of `checkpoint`'s sharded optimizer state into `optimizer`, read at this world size (DCP reads
    the chunks each shard overlaps); the moments in the optimizer's own dtype. Nothing for a checkpoint that holds
    the whole state in trainer_state.pt (it was loaded whole and sliced when the rank joined)."""
    import torch.distributed.checkpoint as dcp

    from asyncgrpo.training.bf16_adamw import MOMENTS, Bf16StateAdamW

    entry = torch.load(checkpoint / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)["optimizer"]
    if "sharded" not in entry:
        return
    reader = _reader(checkpoint, entry, optimizer, model)
    params = dict(model.named_parameters())
    template: dict[str, torch.Tensor] = {}
    for key, meta in _saved(checkpoint, reader):
        param = params[key.rsplit(_SEP, 1)[0]]
        if tuple(meta.size) == tuple(param.shape):  # a moment: sharded as its parameter
            dtype = torch.bfloat16 if isinstance(optimizer, Bf16StateAdamW) and key.rsplit(_SEP, 1)[1] in MOMENTS else param.dtype
            template[key] = torch.empty_like(param, dtype=dtype, requires_grad=False)
        else:  # the step count
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(template, storage_reader=reader)
    optimizer.state.clear()
    for key, value in template.items():
        name, field = key.rsplit(_SEP, 1)
        optimizer.state[params[name]][field] = value


def _reader(checkpoint: Path, entry: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
    """DCP's reader of `checkpoint`'s sharded optimizer state; ValueError if it is not whole or of other parameters."""
    import torch.distributed.checkpoint as dcp

    problem = sharded_optimizer_problem(checkpoint)
    if problem:
        raise ValueError(f"checkpoint {checkpoint} has no whole optimizer state: {problem}")
    if entry["names"] != parameter_names(optimizer, model):
        saved, here = set(chain(*entry["names"])), set(chain(*parameter_names(optimizer, model)))
        raise ValueError(f"checkpoint {checkpoint}'s optimizer state is of other parameters than this model's: only there "
                         f"{sorted(saved - here)[:5]}, only here {sorted(here - saved)[:5]} (or in another order)")
    return dcp.FileSystemReader(checkpoint / entry["sharded"])


def _saved(checkpoint: Path, reader: Any) -> list[tuple[str, Any]]:
    """The keys of the saved state and their tensors' metadata (size, dtype); ValueError for anything but a tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found = list(reader.read_metadata().state_dict_metadata.items())
    for key, meta in found:
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"checkpoint {checkpoint}'s optimizer state holds {key!r}, which is not a tensor")
    return found


def _check_every_rank_sees(checkpoint: Path, share: RankShare) -> None:
    """DiskError on every rank, naming the ranks that do not see `checkpoint`, if any does not (one collective)."""
    seen = torch.tensor([int(checkpoint.is_dir())], device=share.device)
    every = [torch.zeros_like(seen) for _ in range(share.world_size)]
    dist.all_gather(every, seen)
    blind = [rank for rank, flag in enumerate(every) if not int(flag)]
    if blind:
        raise DiskError(
            f"trainer rank(s) {', '.join(map(str, blind))} of {share.world_size} do not see the checkpoint directory "
            f"{checkpoint}: with train.sharding: fsdp every rank writes its shards of the optimizer state there itself. "
            f"Fix: put run.output_dir on a file system every rank's node mounts at the same path (NFS, a shared volume), "
            f"or use train.sharding: ddp (rank 0 writes the whole checkpoint).")


def _write_manifest(directory: Path, metadata: Any, world_size: int) -> None:
    """Rank 0, after every rank's writes: the manifest of `directory`'s files, each checked to hold what DCP wrote."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    files: dict[str, int] = {}
    for name in [*sorted(ends), ".metadata"]:
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < ends.get(name, 0):
            seen = "is not there" if size is None else f"has {size} bytes of the {ends[name]} written"
            raise DiskError(
                f"{path}, a file of the sharded optimizer state written by a trainer rank, {seen} as trainer rank 0 sees "
                f"it. Fix: put run.output_dir on a file system every rank's node shares (writes visible to the others "
                f"once closed), or use train.sharding: ddp.")
        files[name] = size
    manifest = {"format": "torch.distributed.checkpoint", "world_size": world_size, "files": files}
    (directory / OPTIMIZER_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
