"""How each `train.loss.type` turns masked per-token losses into the loss of one micro-batch of an update.

The normaliser belongs to the whole optimizer update (all its micro-batches, on every data-parallel rank), so the
summed gradients of the micro-batches equal the gradient of the update batch (training/loss.py):
- token (dapo, cispo, vespo, a plug-in by default): sum / the update's loss tokens (TRL's num_items_in_batch);
- sequence_mean (grpo, sapo, a plug-in with normalization: sequence): sum of each sequence's token mean / the
  update's sequences;
- sequence_sum (luspo): sum / the update's sequences;
- constant (dr_grpo): sum / (the update's sequences x generation.max_new_tokens);
- micro_token (bnpo, TRL's "local batch"): the micro-batch's token mean / the update's micro-batches. Only this
  one depends on how the update is cut into micro-batches, as TRL's does.
Only sequences with at least one loss token count (the trainer never forwards the others).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from asyncgrpo.loss_config import Aggregation


def aggregate(per_token: Tensor, mask: Tensor, aggregation: Aggregation, normalizer: float) -> Tensor:
    """`per_token` `[B, T]` (any value outside `mask`), `mask` `[B, T]` bool; a scalar with grad."""
    masked = per_token.masked_fill(~mask, 0.0)
    if aggregation in ("token", "sequence_sum", "constant"):
        return masked.sum() / normalizer
    if aggregation == "sequence_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1).to(masked.dtype)).sum() / normalizer
    if aggregation == "micro_token":
        return masked.sum() / mask.sum().clamp(min=1).to(masked.dtype) / normalizer
    raise ValueError(f"unknown aggregation {aggregation!r}")


def update_normalizer(aggregation: Aggregation, loss_tokens: Sequence[int], *, max_new_tokens: int, micro_batches: int) -> int:
    """The normaliser of an update from its sequences' loss-token counts (each > 0); 0 when it has none."""
    if not loss_tokens:
        return 0
    if aggregation == "token":
        return sum(loss_tokens)
    if aggregation in ("sequence_mean", "sequence_sum"):
        return len(loss_tokens)
    if aggregation == "constant":
        return len(loss_tokens) * max_new_tokens
    return micro_batches
