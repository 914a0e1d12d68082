"""`DataParallel`: one `TorchTrainer`'s place among the ranks of a data-parallel trainer (`train.world_size`).

Job: hold this rank's DDP wrapper of the model, say which groups of an update are this rank's,
and sum what the ranks computed (the gradients, the loss and the loss statistics), so the ranks
together make exactly the update one process makes on the whole batch. The process group
(`torch.distributed`, gloo on CPU, NCCL on GPU) is joined by the caller first
(training/ray_trainer.py). `RankShare` is the part `train.sharding: fsdp` shares
(training/sharding.py): the share, the reduction of the loss statistics, the count of rounds.

Invariants:
- Every rank sees the whole batch: the split into updates and each update's normaliser (its loss
  tokens, or its sequences) are computed from all of it, identically on every rank. A rank's loss
  is the sum over its own sequences divided by that global normaliser, so the ranks' losses add
  up to the single-process loss.
- Gradients are all-reduced by SUM (a DDP communication hook), not averaged as DDP does by
  default: the sum of the ranks' gradients is the single-process gradient of the update, equal up
  to the order of float additions. Clipping and the optimizer then run on identical gradients on
  every rank, so the weights stay identical without being broadcast (with
  `train.optimizer_state_dtype: bfloat16` too: every rank seeds its rounding noise with run.seed).
- Every rank makes exactly one synchronising backward pass per update (`no_sync` for its other
  micro-batches), a rank without a sequence in the update a zero-loss one, so every rank makes
  the same collectives in the same order. Buffers are not broadcast at each forward (ranks make
  different numbers of forwards).
"""

# No `from __future__ import annotations`: DDP checks the communication hook's annotations at run time.
import contextlib
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from asyncgrpo.training.loss import LossStats

T = TypeVar("T")


def _sum_gradients(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce a bucket of gradients by SUM (DDP's default divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    assert work is not None  # async_op=True always returns the work handle
    return work.get_future().then(lambda fut: fut.value()[0])


class RankShare:
    """This rank's share of an update and the sums over every rank's; see the module docstring."""

    def __init__(self, *, rank: int, world_size: int, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs the torch.distributed process group to be initialised first")
        self.rank, self.world_size, self.device = rank, world_size, device

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items (every world_size-th, starting at its rank): the ranks' shares partition `items`."""
        return list(items[self.rank :: self.world_size])

    def gather_rows(self, rows: Tensor) -> Tensor:
        """Every rank's `rows` (a `[k, n_rank]` tensor on the CPU, n may differ by rank) side by side, on every rank:
        per-token diagnostics computed from the whole batch rather than one rank's share (training/offpolicy.py)."""
        count = torch.tensor([rows.shape[1]], device=self.device)
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count)
        width = int(max(int(c) for c in counts))
        padded = torch.zeros(rows.shape[0], width, dtype=rows.dtype, device=self.device)
        padded[:, : rows.shape[1]] = rows.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:, : int(n)] for part, n in zip(parts, counts, strict=True)], dim=1).cpu()

    def rounds(self, count: int) -> int:
        """How many forward passes every rank makes where this one has `count` to make: `count` itself (DDP
        communicates only in the synchronising backward pass, so the ranks' counts may differ)."""
        return count

    def reduce(self, total: Tensor, stats: LossStats) -> tuple[Tensor, LossStats]:
        """The update's loss and statistics over every rank (sums added, the ratio maximum the largest)."""
        sums = torch.stack([total.to(torch.float64), stats.tokens, stats.clipped, stats.ratio_sum, stats.is_truncated,
                            stats.kl_sum, stats.entropy_sum])
        dist.all_reduce(sums)
        ratio_max = stats.ratio_max.clone()
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        total_sum, tokens, clipped, ratio_sum, is_truncated, kl_sum, entropy_sum = sums.unbind()
        return total_sum, LossStats(tokens, clipped, ratio_sum, ratio_max, is_truncated, kl_sum, entropy_sum)


class DataParallel(RankShare):
    """`train.sharding: ddp`: a full copy of the model and optimizer per rank; DDP sums the gradients."""

    def __init__(self, model: torch.nn.Module, *, rank: int, world_size: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(rank=rank, world_size=world_size, device=device)
        with warnings.catch_warnings():
            # torch 2.13 renames broadcast_buffers=False (torch >= 2.4 has no other name for it), and warns.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            self.module = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
            )
        self.module.register_comm_hook(None, _sum_gradients)

    def sync(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around one micro-batch's forward and backward: gradients are summed over the ranks only for the last."""
        return contextlib.nullcontext() if last else self.module.no_sync()
