"""training/packing.py's pure parts: the token-budget packer and the packed row layout (positions, scored
positions, the completion grid, the repetition penalty's context) against the padded collation; the choice of
varlen flash attention, else varlen SDPA."""

from __future__ import annotations

import importlib.util
import logging
import random
import types

import pytest
import torch

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config
from asyncgrpo.sampling import seen_before
from asyncgrpo.training.batch import TrainSequence, collate
from asyncgrpo.training.packing import collate_packed, input_length, pack, pack_sequences, prefer_varlen, prefer_varlen_flash
from asyncgrpo.training.varlen_attention import NAME as VARLEN_SDPA

ALGORITHM = algorithm_for(Config())


def test_pack_first_fit_decreasing_within_budget():
    assert pack([3, 8, 2, 5, 4], 10) == [[1, 2], [3, 4], [0]]  # 8 | 5+4 | 3; then 2 fits beside 8 (longest first, first fit)
    assert pack([], 10) == []
    assert pack([10, 10], 10) == [[0], [1]]


def test_pack_random_lengths_keeps_every_index_once_and_respects_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.randrange(1, 60)
        lengths = [rng.randrange(1, 80) for _ in range(rng.randrange(0, 30))]
        bins = pack(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for b in bins:
            assert b == sorted(b)
            assert sum(lengths[i] for i in b) <= budget or len(b) == 1  # only a lone over-budget sequence exceeds it
        assert pack(lengths, budget) == bins  # deterministic


def test_pack_gives_an_over_budget_sequence_a_micro_batch_of_its_own():
    assert pack([4, 30, 5], 10) == [[1], [0, 2]]


@pytest.mark.parametrize("budget, lengths", [(0, [1]), (5, [2, 0])])
def test_pack_refuses_a_budget_or_length_below_one(budget, lengths):
    with pytest.raises(ValueError, match="budget|length"):
        pack(lengths, budget)


def seq(prompt, completion, versions=None) -> TrainSequence:
    return TrainSequence(
        prompt_ids=tuple(prompt), completion_ids=tuple(completion), logp_gen=tuple(-0.1 * (i + 1) for i in range(len(completion))),
        rollout=None, has_loss=True, versions=tuple(versions or [0] * len(completion)),
    )


SEQS = [seq([1, 5, 6], [7, 8, 9, 7]), seq([2], [3]), seq([4, 4], [5, 6, 4], versions=[0, 1, 1])]


def test_pack_sequences_uses_input_lengths():
    assert [input_length(s) for s in SEQS] == [6, 1, 4]
    assert pack_sequences(SEQS, 7) == [[SEQS[0], SEQS[1]], [SEQS[2]]]


def test_packed_row_layout_and_completion_grid_match_the_padded_batch():
    packed = collate_packed(SEQS, pad_id=0, version=2, device=torch.device("cpu"), algorithm=ALGORITHM)
    padded = collate(SEQS, pad_id=0, version=2, device=torch.device("cpu"), algorithm=ALGORITHM)
    assert packed.input_ids.tolist() == [[1, 5, 6, 7, 8, 9, 2, 4, 4, 5, 6]]  # no padding
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3]]
    assert packed.attention_mask is None and "attention_mask" not in packed.model_inputs()
    assert packed.keep.tolist() == [2, 3, 4, 5, 6, 8, 9, 10]  # the inputs that predict each completion token
    assert packed.scored_targets.tolist() == [[7, 8, 9, 7, 3, 5, 6, 4]]
    for name in ("targets", "logp_gen", "mask", "advantages", "staleness"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    scored = torch.arange(1.0, 9.0).unsqueeze(0)
    assert packed.to_grid(scored).tolist() == [[1, 2, 3, 4], [5, 0, 0, 0], [6, 7, 8, 0]]


def test_packed_grid_carries_gradient_back_to_the_scored_positions():
    packed = collate_packed(SEQS, pad_id=0, version=0, device=torch.device("cpu"), algorithm=ALGORITHM)
    scored = torch.ones(1, 8, requires_grad=True)
    (packed.to_grid(scored) * torch.arange(12.0).view(3, 4)).sum().backward()
    assert scored.grad.tolist() == [[0, 1, 2, 3, 4, 8, 9, 10]]


def test_packed_repetition_context_is_each_sequences_own():
    rng = random.Random(1)
    seqs = [seq([rng.randrange(1, 9) for _ in range(rng.randrange(1, 5))], [rng.randrange(1, 9) for _ in range(rng.randrange(1, 6))])
            for _ in range(6)]
    packed = collate_packed(seqs, pad_id=0, version=0, device=torch.device("cpu"), algorithm=ALGORITHM)
    padded = collate(seqs, pad_id=0, version=0, device=torch.device("cpu"), algorithm=ALGORITHM)
    length = padded.input_ids.shape[1]
    positions = torch.arange(length - padded.completion_width, length)
    expected = seen_before(padded.input_ids, padded.attention_mask, 9, positions)[packed.valid]
    assert torch.equal(packed.seen(9)[0], expected)
    assert torch.equal(padded.seen(9), seen_before(padded.input_ids, padded.attention_mask, 9, positions))


class FlashCapableModel:
    """What `prefer_varlen_flash` reads of a transformers model: its support flag, its config, the switch."""

    _supports_flash_attn = True

    def __init__(self, refuse: Exception | None = None) -> None:
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")
        self.refuse = refuse

    def set_attn_implementation(self, name: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.config._attn_implementation = name


@pytest.fixture
def flash_attn_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))


def test_packing_on_cuda_with_flash_attn_installed_switches_to_varlen_flash(flash_attn_installed):
    model = FlashCapableModel()
    assert prefer_varlen_flash(model, torch.device("cuda")) == "flash_attention_2"
    assert model.config._attn_implementation == "flash_attention_2"


def test_packing_keeps_the_models_attention_on_cpu_without_flash_attn_or_when_the_switch_fails(flash_attn_installed, caplog):
    cpu = FlashCapableModel()
    assert prefer_varlen_flash(cpu, torch.device("cpu")) is None and cpu.config._attn_implementation == "sdpa"
    refused = FlashCapableModel(refuse=ImportError("FlashAttention2 needs compute capability 8.0"))
    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
        assert prefer_varlen_flash(refused, torch.device("cuda")) is None
    assert refused.config._attn_implementation == "sdpa" and "compute capability" in caplog.text


def test_packing_without_flash_attn_installed_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    model = FlashCapableModel()
    assert prefer_varlen_flash(model, torch.device("cuda")) is None and model.config._attn_implementation == "sdpa"


def test_packing_prefers_varlen_flash(flash_attn_installed):
    assert prefer_varlen(torch.device("cuda"), FlashCapableModel(), None) == ["flash_attention_2"]


def test_packing_without_varlen_flash_switches_each_sdpa_model_to_varlen_sdpa():
    cpu, reference = FlashCapableModel(), FlashCapableModel()
    assert prefer_varlen(torch.device("cpu"), cpu, reference) == [VARLEN_SDPA, VARLEN_SDPA]
    assert cpu.config._attn_implementation == reference.config._attn_implementation == VARLEN_SDPA
    eager = FlashCapableModel()
    eager.config._attn_implementation = "eager"
    assert prefer_varlen(torch.device("cpu"), eager) == [None] and eager.config._attn_implementation == "eager"
