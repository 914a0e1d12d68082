"""Padding-free packed micro-batches (`train.micro_batch_tokens`): several sequences in one row, attention confined to each.

Job: `pack` cuts a list of sequence lengths into micro-batches by a token budget (a pure function); `collate_packed`
lays one micro-batch out as a single row `[1, T]` with no padding, each sequence with its own position ids
0, 1, ... and no attention mask, which transformers turns into attention confined to each sequence (varlen
flash attention, or a block-diagonal mask for eager / flex); `prefer_varlen` switches the trainer's models to
`flash_attention_2` where `flash_attn` is installed on CUDA, else from sdpa to SDPA per packed sequence
(training/varlen_attention.py: sum L_i^2 attention, no T x T mask); `check_confinement` proves that the model
confines attention before the first step, and refuses it (a `ConfigError`) otherwise.

Invariants:
- `pack` keeps every index exactly once; a micro-batch's tokens never exceed the budget, except a sequence longer
  than the budget, which is a micro-batch of its own (documented handling: it is never split).
- The loss sees exactly what it sees with padded micro-batches: the completion grid `[N, C]` (targets, log-probs,
  mask, advantages, staleness) is the padded one (training/batch.py `completion_grid`); only the forward's
  input layout differs, and the scored log-probs are scattered back into the grid. So the per-update normaliser
  and every loss type keep their meaning, and packed and padded updates agree to float tolerance.
- Only the logits that predict completion tokens are kept (K of them, no padding: `logits_to_keep` as indices).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.errors import ConfigError
from asyncgrpo.training import varlen_attention
from asyncgrpo.training.batch import MicroBatch, TrainSequence, completion_grid

log = logging.getLogger("asyncgrpo")

KEY = "train.micro_batch_tokens"
# Logits of a sequence packed after another must equal its logits alone to this (float32 forward).
CONFINEMENT_TOLERANCE = 1e-4


def input_length(seq: TrainSequence) -> int:
    """Tokens the sequence occupies in a row: its prompt and all but its last completion token."""
    return len(seq.prompt_ids) + len(seq.completion_ids) - 1


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` cut into micro-batches of at most `budget` tokens each, first-fit decreasing.

    Deterministic: longest first (ties by index), each into the first micro-batch it fits in; indices ascend
    inside a micro-batch. A length over `budget` gets a micro-batch of its own."""
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length < 1:
            raise ValueError(f"sequence {index} has length {length}; every packed sequence has at least one token")
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(budget - length)
    return [sorted(b) for b in bins]


def pack_sequences(seqs: Sequence[TrainSequence], budget: int) -> list[list[TrainSequence]]:
    """`seqs` as packed micro-batches (`pack` on their input lengths)."""
    return [[seqs[i] for i in micro] for micro in pack([input_length(s) for s in seqs], budget)]


@dataclass
class PackedBatch(MicroBatch):
    """One row `[1, T]` of N sequences back to back (no attention mask, per-sequence position ids), and the padded
    completion grid `[N, C]`. `keep` `[K]`: the row positions whose logits predict the K completion tokens, in
    grid order (row by row); `valid` `[N, C]`: where those K sit in the grid; `sequence_of` `[T]`: each position's
    sequence."""

    keep: Tensor
    valid: Tensor
    sequence_of: Tensor

    def model_inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}

    @property
    def logits_to_keep(self) -> int | Tensor:
        return self.keep

    def kept(self, logits: Tensor) -> Tensor:
        return logits if logits.shape[1] == self.keep.numel() else logits[:, self.keep, :]

    @property
    def scored_targets(self) -> Tensor:
        return self.targets[self.valid].unsqueeze(0)

    def to_grid(self, scored: Tensor) -> Tensor:
        return scored.new_zeros(self.valid.shape).masked_scatter(self.valid, scored.reshape(-1))

    def seen(self, vocab_size: int) -> Tensor:
        """Bool `[1, K, V]`: token v occurs in the scored position's own sequence at or before it."""
        ids, length, n = self.input_ids[0], self.input_ids.shape[1], self.valid.shape[0]
        first = torch.full((n * vocab_size,), length, dtype=torch.long, device=ids.device)
        first.scatter_reduce_(0, self.sequence_of * vocab_size + ids, torch.arange(length, device=ids.device), reduce="amin")
        return (first.view(n, vocab_size)[self.sequence_of[self.keep]] <= self.keep[:, None]).unsqueeze(0)


def collate_packed(seqs: list[TrainSequence], *, pad_id: int, version: int, device: torch.device,
                   algorithm: Algorithm) -> PackedBatch:
    """`seqs` (each with completion tokens) packed into one row on `device`; staleness against `version`."""
    grid = completion_grid(seqs, pad_id=pad_id, version=version, device=device, algorithm=algorithm)
    ids: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    keep: list[int] = []
    for index, s in enumerate(seqs):
        start, n = len(ids), input_length(s)
        ids += list(s.prompt_ids) + list(s.completion_ids[:-1])
        positions += range(n)
        owner += [index] * n
        keep += range(start + len(s.prompt_ids) - 1, start + n)
    lengths = torch.tensor([len(s.completion_ids) for s in seqs], device=device)
    valid = torch.arange(grid.width, device=device)[None, :] < lengths[:, None]
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        attention_mask=None,
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        **grid.micro_batch_fields(),
        keep=torch.tensor(keep, dtype=torch.long, device=device),
        valid=valid,
        sequence_of=torch.tensor(owner, dtype=torch.long, device=device),
    )


def prefer_varlen_flash(model: Any, device: torch.device) -> str | None:
    """Switch `model` to transformers' `flash_attention_2` (varlen kernels over packed rows: no T^2 work across a row's
    sequences) when the `flash_attn` package is installed, the device is CUDA and the model supports it; returns the
    implementation chosen, None when it keeps its own."""
    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None or not getattr(model, "_supports_flash_attn", False):
        return None
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if current == "flash_attention_2":
        return current
    try:
        model.set_attn_implementation("flash_attention_2")
    except (ImportError, ValueError) as exc:  # an installed flash_attn this GPU or dtype cannot use: keep the current one
        log.warning("packing: flash_attention_2 is installed but cannot serve %s (%s); packed rows use %s attention",
                    type(model).__name__, exc, current)
        return None
    log.info("packing: %s uses flash_attention_2 (varlen) for packed rows, was %s", type(model).__name__, current)
    return "flash_attention_2"


def prefer_varlen(device: torch.device, *models: Any) -> list[str | None]:
    """Give each of `models` (None skipped: e.g. no KL reference) varlen attention for packed rows: flash where
    `prefer_varlen_flash` can, else `varlen_attention.NAME` where the model uses sdpa; the implementation each
    switched to, None where it keeps its own (eager / flex confine a packed row by a block-diagonal mask)."""
    chosen: list[str | None] = []
    for model in models:
        if model is not None:
            flash = prefer_varlen_flash(model, device)
            chosen.append(flash or (varlen_attention.NAME if varlen_attention.use_varlen_sdpa(model) else None))
    return chosen


def accepts_position_ids(model: Any) -> bool:
    """Whether `model`'s forward takes `position_ids` (by name, or through **kwargs as PEFT wrappers do)."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def check_confinement(model: Any, *, budget: int, model_path: str, device: torch.device) -> None:
    """ConfigError unless `model` confines attention to each packed sequence: the logits of a sequence packed
    after another must equal its logits alone (a forward of 9 tokens, float32, no grad)."""
    if not accepts_position_ids(model):
        raise ConfigError(
            f"{KEY} = {budget} packs several sequences into one row and gives each its own position ids, but the "
            f"forward of model {type(model).__name__} (model.path = {model_path!r}) takes no position_ids argument, "
            f"so its packed sequences could not restart their positions. Fix: unset {KEY} (padded micro-batches of "
            f"train.micro_batch_size), or use a transformers causal LM (their forwards take position_ids)."
        )
    vocab = int(getattr(model.config, "vocab_size", 2))
    first, second = [i % vocab for i in (1, 5, 2, 7, 3)], [i % vocab for i in (4, 6, 1, 3)]
    with torch.no_grad():  # the trainer's model is in eval mode (training/trainer.py), so no dropout here
        packed = model(input_ids=torch.tensor([first + second], device=device),
                       position_ids=torch.tensor([list(range(5)) + list(range(4))], device=device), use_cache=False).logits
        alone = model(input_ids=torch.tensor([second], device=device),
                      position_ids=torch.tensor([list(range(4))], device=device), use_cache=False).logits
    gap = float((packed[0, 5:].float() - alone[0].float()).abs().max())
    if not gap <= CONFINEMENT_TOLERANCE:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ConfigError(
            f"{KEY} = {budget} packs several sequences into one row, but model {type(model).__name__} "
            f"(model.path = {model_path!r}) with attention implementation {implementation!r} lets a packed sequence "
            f"attend to the one before it (its logits differ by {gap:.3g} from the sequence alone; the limit is "
            f"{CONFINEMENT_TOLERANCE:g}), which would train on cross-sequence attention. Fix: unset {KEY} (padded "
            f"micro-batches of train.micro_batch_size), or use a transformers model whose attention honours packed "
            f"position ids (sdpa, eager, flex_attention or flash_attention_2, e.g. Llama in transformers >= 4.54)."
        )
