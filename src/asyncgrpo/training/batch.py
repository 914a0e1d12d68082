"""A batch of groups as the trainer's tensors: one sequence per rollout, collated into micro-batches.

Job: `sequences(group)` turns each rollout into a `TrainSequence` (prompt ids, completion ids, generation
log-probs, loss mask, token versions), or one per sample of a split agent episode (`Completion.segments`), each
with the rollout's advantage; `collate` pads a list of them into a `MicroBatch` on a device, its
advantages given by the algorithm (algorithms/: `[B]` per sequence, or `[B, C]` per token);
`split_even` and `chunks` cut a batch into updates and micro-batches.

Invariants:
- Prompts are left-padded and completions right-padded, so every completion starts at the same column and
  only the last C logits are needed; padding is never a loss token and never attended to.
- A sequence's loss tokens are its completion tokens (its model's tokens only, for an episode), none when
  it is truncated and `rollout.mask_truncated` is on.
- A rollout with a non-finite advantage, or a completion without a prompt to predict it from, is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.sampling import seen_before
from asyncgrpo.types import Group, Rollout


@dataclass
class TrainSequence:
    """One rollout as the trainer sees it (`rollout` None: a filler without loss tokens). `logp_prox` `[C]` is
    filled for `decoupled`."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logp_gen: tuple[float, ...]
    rollout: Rollout | None
    has_loss: bool
    logp_prox: Tensor | None = None
    loss_mask: tuple[bool, ...] | None = None  # an episode's: False on the environment's tokens
    versions: tuple[int, ...] = ()  # the policy version of each completion token (() for the filler)

    @property
    def loss_tokens(self) -> int:
        if not self.has_loss:
            return 0
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    def mask_row(self, width: int) -> list[bool]:
        """Which of `width` completion columns are loss tokens (padding never is)."""
        row = [self.has_loss and m for m in self.loss_mask] if self.loss_mask is not None else [self.has_loss] * len(self.completion_ids)
        return row + [False] * (width - len(row))


@dataclass
class MicroBatch:
    """Collated sequences, padded: one sequence per row.

    input_ids/attention_mask/position_ids `[B, P + C - 1]`; targets/logp_gen/mask/staleness (and
    logp_prox) `[B, C]`; advantages `[B]`, or `[B, C]` per token (the algorithm's `token_advantages`).
    The completion grid (targets and what follows) is the layout of the loss (training/loss.py) whatever
    the input layout; training/packing.py's `PackedBatch` has the same grid and a packed input.
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor
    targets: Tensor
    logp_gen: Tensor
    logp_prox: Tensor | None
    mask: Tensor
    advantages: Tensor
    completion_width: int
    staleness: Tensor  # [B, C]: the step's version minus the version that generated each token

    def model_inputs(self) -> dict[str, Any]:
        """The forward's keyword arguments for the inputs."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    @property
    def logits_to_keep(self) -> int | Tensor:
        """transformers' `logits_to_keep`: the positions whose logits are scored (here the last C)."""
        return self.completion_width

    def kept(self, logits: Tensor) -> Tensor:
        """The scored logits `[B, C, V]` out of the forward's (whether it kept only those or not)."""
        return logits[:, -self.completion_width :, :]

    @property
    def scored_targets(self) -> Tensor:
        """The token each scored logit predicts, aligned with `kept(...)`."""
        return self.targets

    def to_grid(self, scored: Tensor) -> Tensor:
        """A per-scored-position tensor as the completion grid `[B, C]` (padded: already is)."""
        return scored

    def seen(self, vocab_size: int) -> Tensor:
        """The repetition penalty's context of each scored position, bool `[B, C, V]` (sampling.py `seen_before`)."""
        assert self.attention_mask is not None
        length = self.input_ids.shape[1]
        positions = torch.arange(length - self.completion_width, length, device=self.input_ids.device)
        return seen_before(self.input_ids, self.attention_mask, vocab_size, positions)


@dataclass
class CompletionGrid:
    """What every micro-batch holds per completion token, `[B, C]` (advantages `[B]` or `[B, C]`)."""

    targets: Tensor
    logp_gen: Tensor
    logp_prox: Tensor | None
    mask: Tensor
    advantages: Tensor
    staleness: Tensor

    @property
    def width(self) -> int:
        return int(self.targets.shape[1])

    def micro_batch_fields(self) -> dict[str, Any]:
        """The grid's fields of a `MicroBatch` (every input layout shares them)."""
        return {"targets": self.targets, "logp_gen": self.logp_gen, "logp_prox": self.logp_prox, "mask": self.mask,
                "advantages": self.advantages, "completion_width": self.width, "staleness": self.staleness}


def split_even(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Split into `parts` contiguous chunks whose sizes differ by at most one (larger first)."""
    n = len(items)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def chunks(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def by_length(seqs: Sequence[TrainSequence]) -> list[TrainSequence]:
    """Similar lengths together: less padding in a micro-batch, the same sums."""
    return sorted(seqs, key=lambda s: (len(s.prompt_ids) + len(s.completion_ids), len(s.completion_ids)))


def pad_id_of(tokenizer: Any) -> int:
    """The token that pads a micro-batch: the tokenizer's pad token, else its end of sequence, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def filler(pad_id: int) -> TrainSequence:
    """One pad token and no loss token: a rank's part of an update it has no sequence of (training/data_parallel.py)."""
    return TrainSequence(prompt_ids=(pad_id,), completion_ids=(pad_id,), logp_gen=(0.0,), rollout=None, has_loss=False)


def sequences(group: Group, *, mask_truncated: bool) -> list[TrainSequence]:
    if not group.rollouts:
        raise ValueError(f"group of prompt {group.prompt.id} has no rollouts; only groups with survivors can be trained")
    prompt_ids = tuple(group.prompt.token_ids)
    out = []
    for rollout in group.rollouts:
        if not math.isfinite(rollout.advantage):
            raise ValueError(f"prompt {group.prompt.id}: advantage {rollout.advantage} is not finite")
        for c in (*rollout.completion.segments, rollout.completion):  # a split agent episode: one sequence per sample
            own_prompt = prompt_ids if c.prompt_token_ids is None else tuple(c.prompt_token_ids)
            if c.token_ids and not own_prompt:
                raise ValueError(
                    f"prompt {group.prompt.id} has no tokens: the first completion token has nothing to be predicted from"
                )
            out.append(
                TrainSequence(
                    prompt_ids=own_prompt,
                    completion_ids=tuple(c.token_ids),
                    logp_gen=tuple(c.logprobs),
                    rollout=rollout,
                    has_loss=not (rollout.completion.truncated and mask_truncated),  # a cut episode: all its samples
                    loss_mask=c.loss_mask,
                    versions=tuple(c.versions),
                )
            )
    return out


def completion_grid(seqs: list[TrainSequence], *, pad_id: int, version: int, device: torch.device, algorithm: Algorithm) -> CompletionGrid:
    """The completions of `seqs` (each with completion tokens) right-padded into rows on `device`; staleness against `version`."""
    width_c = max(len(s.completion_ids) for s in seqs)
    assert width_c > 0, "micro-batches hold only sequences with completion tokens"
    target_rows, gen_rows, mask_rows, prox_rows, stale_rows = [], [], [], [], []
    for s in seqs:
        c = len(s.completion_ids)
        target_rows.append(list(s.completion_ids) + [pad_id] * (width_c - c))
        gen_rows.append(list(s.logp_gen) + [0.0] * (width_c - c))
        stale_rows.append([version - v for v in s.versions] + [0] * (width_c - len(s.versions)))
        mask_rows.append(s.mask_row(width_c))
        if s.logp_prox is not None:
            prox_rows.append(torch.nn.functional.pad(s.logp_prox, (0, width_c - c)))
    logp_gen = torch.tensor(gen_rows, dtype=torch.float32, device=device)
    mask = torch.tensor(mask_rows, dtype=torch.bool, device=device)
    logp_prox = None
    if prox_rows:
        if len(prox_rows) != len(seqs):
            raise AssertionError("proximal log-probs missing for part of a micro-batch")
        logp_prox = torch.stack(prox_rows).to(device)
    return CompletionGrid(
        targets=torch.tensor(target_rows, dtype=torch.long, device=device),
        logp_gen=logp_gen,
        logp_prox=logp_prox,
        mask=mask,
        advantages=algorithm.token_advantages([s.rollout for s in seqs], logp_gen, mask),
        staleness=torch.tensor(stale_rows, dtype=torch.long, device=device),
    )


def collate(seqs: list[TrainSequence], *, pad_id: int, version: int, device: torch.device, algorithm: Algorithm) -> MicroBatch:
    """`seqs` (each with completion tokens) padded into one micro-batch on `device`; staleness against `version`."""
    grid = completion_grid(seqs, pad_id=pad_id, version=version, device=device, algorithm=algorithm)
    width_p = max(len(s.prompt_ids) for s in seqs)
    length = width_p + grid.width - 1
    input_rows, attn_rows = [], []
    for s in seqs:
        body = list(s.prompt_ids) + list(s.completion_ids[:-1])
        left = width_p - len(s.prompt_ids)
        right = length - left - len(body)
        input_rows.append([pad_id] * left + body + [pad_id] * right)
        attn_rows.append([0] * left + [1] * len(body) + [0] * right)
    attention_mask = torch.tensor(attn_rows, dtype=torch.long, device=device)
    return MicroBatch(
        input_ids=torch.tensor(input_rows, dtype=torch.long, device=device),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        **grid.micro_batch_fields(),
    )
