"""`FullySharded`: one rank of a data-parallel trainer whose model is sharded by FSDP2 (`train.sharding: fsdp`).

Job: shard the model's parameters, their gradients and the optimizer's state across the ranks
(`torch.distributed.fsdp.fully_shard`: each decoder layer one group, the rest of the model the
root group), sum the ranks' gradients, and gather the full weights once, for rank 0, when a generator or
a checkpoint needs them (a checkpoint's optimizer state is never gathered: each rank writes its shards,
training/sharded_state.py). The share of each update and the
reduction of the loss statistics are data parallelism's (training/data_parallel.py `RankShare`);
`join` picks DDP or this, as `train.sharding` says.

Invariants:
- A step equals the single-process step on the same batch (up to float summation order): the
  normaliser is the whole update's, and each micro-batch's gradients are reduce-scattered by SUM
  (the divide factor is 1), so every rank holds its shard of the single-process gradient. Clipping
  takes the norm of the whole gradient (a DTensor reduction), AdamW updates each rank's shard.
- Every rank makes the same collectives in the same order: each forward pass all-gathers the
  parameters, so the ranks make the same number of forward passes (`rounds`: the largest count
  over the ranks; a rank with fewer makes zero-loss passes), and every rank takes part in each
  gather (`full_weights`), whose full tensors only rank 0 keeps.
- The trainer's parameters stay float32 master weights (sharded); `train.precision: bfloat16` or
  `float16` runs forward and backward in that dtype through FSDP2's `MixedPrecisionPolicy` (gradients
  reduced in float32). float16's loss scaler is the trainer's own `torch.amp.GradScaler`: its inf/NaN
  check on the sharded gradients (DTensors) is reduced over the ranks by DTensor itself (a MAX of
  each rank's verdict), so every rank skips the same updates and keeps the same scale. FSDP2's float16
  gradients are those of float16 weights (autocast's, of float32 ones), so at a high scale they can
  overflow in an update where the single process's do not; the scaler then backs off once.
- The optimizer is the trainer's own object, re-pointed at the sharded parameters, its state (the
  loaded checkpoint's, if it held the whole state) sliced to each rank's shard without communication (a sharded
  checkpoint's shards are read after this, each rank its own: sharded_state.read_shards). Checkpoints
  hold the full weights in the single-process layout and the optimizer state as each rank's shards, keyed by
  parameter name (training/sharded_state.py), so any world size, sharded or not, resumes them.
- LoRA (`train.lora`): the peft model is sharded as it is, the frozen base weights and the adapters
  in the same groups (FSDP2 all-gathers both and reduce-scatters only the gradients that exist: the
  adapters'). The generators get the merged weights: `lora.merged_state` computes W + scale * B @ A
  on the shards (DTensor operations: every rank takes part) and `full_weights` gathers the result;
  checkpoints hold that merged model, the gathered adapter in peft's layout and the adapters' optimizer shards.
- The KL reference (`train.loss.kl_coef > 0`) is sharded too: without LoRA its frozen copy is sharded
  like the model (its groups resharded after every forward: it has no backward); with LoRA it is the
  sharded model with its adapters off. Either way its forward all-gathers, so a rank's zero-loss
  filler pass makes that forward too (trainer.py `_backward_without_sequences`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from asyncgrpo.config.train import TrainConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.models.device import PRECISIONS
from asyncgrpo.training.data_parallel import DataParallel, RankShare


def check_torch_supports_fsdp() -> None:
    """ConfigError unless this torch has what FSDPModule sharding here needs (FSDP2's `fully_shard` and a plain-SUM
    gradient reduction, `set_force_sum_reduction_for_comms`: torch 2.8 and later), checked before any rank starts."""
    import torch.distributed.fsdp as fsdp

    module_class = getattr(fsdp, "FSDPModule", None)
    if module_class is None or not hasattr(module_class, "set_force_sum_reduction_for_comms"):
        raise ConfigError(
            f"train.sharding = fsdp needs FSDP2 with a plain-SUM gradient reduction "
            f"(torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms), which torch {torch.__version__} "
            f"does not have. Fix: install torch >= 2.8, or set train.sharding: ddp."
        )


def join(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, *, rank: int, world_size: int,
         device: torch.device, reference: torch.nn.Module | None) -> DataParallel | FullySharded:
    """This rank's place in the data-parallel trainer, as `train.sharding` asks: DDP's copies, or FSDP2's shards (of
    `model` and of the frozen KL `reference`, if any)."""
    if cfg.sharding == "fsdp":
        return FullySharded(model, optimizer, rank=rank, world_size=world_size, device=device, precision=cfg.precision,
                            reference=reference)
    return DataParallel(model, rank=rank, world_size=world_size, device=device)


class FullySharded(RankShare):
    """FSDP2 on `model` and the frozen KL `reference` (in place) for this rank; `optimizer` re-pointed at the sharded
    parameters. See the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int, world_size: int,
                 device: torch.device, precision: str, reference: torch.nn.Module | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

        super().__init__(rank=rank, world_size=world_size, device=device)
        names = {id(p): name for name, p in model.named_parameters()}
        groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        saved = {names[id(p)]: state for p, state in optimizer.state.items()}
        mesh = init_device_mesh(device.type, (world_size,))
        policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32) if precision != "float32" \
            else MixedPrecisionPolicy()
        _shard(model, mesh, policy, reshard_root=None)  # None: the root group stays gathered from forward to backward
        if reference is not None:  # no backward: every group, the root's too, is resharded after each forward
            _shard(reference, mesh, policy, reshard_root=True)
        for sharded in model.modules():
            if isinstance(sharded, FSDPModule):  # SUM over the ranks: the single-process gradient, not the mean
                sharded.set_gradient_divide_factor(1.0)
                sharded.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        self.module = model
        params = dict(model.named_parameters())
        for group, group_names in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = [params[name] for name in group_names]
        optimizer.state.clear()
        for name, state in saved.items():
            param = params[name]
            optimizer.state[param] = {key: _shard_like(value, param) for key, value in state.items()}

    def sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Each micro-batch's gradients are reduce-scattered (summed) in its own backward pass: nothing to defer."""
        return contextlib.nullcontext()

    def rounds(self, count: int) -> int:
        """The largest number of forward passes any rank has to make where this one has `count` (every rank makes it)."""
        counts = torch.tensor([count], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return int(counts.item())

    def full_weights(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The full tensors of `tensors` (a state dict), gathered one at a time: rank 0's, on the CPU; {} on the others."""
        return {name: value for name, value in ((name, self._gather(t)) for name, t in tensors.items()) if value is not None}

    def _gather(self, tensor: Tensor) -> Tensor | None:
        if not isinstance(tensor, DTensor):
            return tensor.detach().cpu() if self.rank == 0 else None
        full = tensor.full_tensor()  # a collective: every rank, the same tensors in the same order
        return full.detach().cpu() if self.rank == 0 else None


def _shard(model: torch.nn.Module, mesh: Any, policy: Any, *, reshard_root: bool | None) -> None:
    """FSDP2 on `model` in place: each decoder layer (the model's `_no_split_modules`) one group, the rest the root's."""
    from torch.distributed.fsdp import fully_shard

    layers = set(getattr(_transformers_model(model), "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_root)


def _shard_like(value: Any, param: Tensor) -> Any:
    """A full optimizer state tensor of `param`'s shape as `param` is sharded (this rank's slice); anything else as is."""
    if isinstance(param, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def _transformers_model(model: torch.nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)  # a peft wrapper
    return get_base() if callable(get_base) else model
