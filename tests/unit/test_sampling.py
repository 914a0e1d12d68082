"""sampling.py against transformers' logits processors on fixed logits (each knob alone, each pair, all of them)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from asyncgrpo.sampling import Processing, kept_support, processed_logits, seen_before

VOCAB = 64


def _fixed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, VOCAB, generator=g) * 3.0  # spread: real truncation at every knob
    context = torch.randint(0, VOCAB, (6, 9), generator=g)
    return logits, context


def _reference(logits: torch.Tensor, context: torch.Tensor, p: Processing) -> torch.Tensor:
    """transformers' processors in vLLM's order: penalty, temperature, min-p, top-k, top-p."""
    chain = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty))
    if p.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(min_p=p.min_p))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1:
        chain.append(TopPLogitsWarper(top_p=p.top_p))
    return chain(context, logits.clone())


KNOBS = {"top_k": 20, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.3}
CASES = [dict(c) for n in range(1, 5) for c in itertools.combinations(KNOBS.items(), n)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("knobs", CASES, ids=lambda c: "+".join(c))
def test_processing_matches_transformers(knobs: dict, temperature: float) -> None:
    logits, context = _fixed()
    p = Processing(temperature=temperature, **knobs)
    seen = torch.zeros(logits.shape, dtype=torch.bool).scatter(1, context, True)
    ours = processed_logits(logits, p, seen=seen)
    theirs = _reference(logits, context, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # the same kept support, token for token
    kept = ~torch.isinf(theirs)
    assert bool((kept.sum(-1) < VOCAB).all()) or knobs == {"repetition_penalty": 1.3}  # the knobs really truncate
    torch.testing.assert_close(ours.log_softmax(-1)[kept], theirs.log_softmax(-1)[kept], rtol=0, atol=1e-5)


def test_per_row_knobs_equal_row_by_row() -> None:
    logits, _ = _fixed()
    top_k = torch.tensor([0, 5, 20, 0, 3, 64])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.99, 0.3])
    min_p = torch.tensor([0.0, 0.2, 0.0, 0.05, 0.0, 0.1])
    batched = kept_support(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    for i in range(logits.shape[0]):
        alone = kept_support(logits[i : i + 1], top_k=int(top_k[i]), top_p=float(top_p[i]), min_p=float(min_p[i]))
        assert torch.equal(batched[i : i + 1], alone)


def test_every_knob_off_is_the_tempered_distribution() -> None:
    logits, _ = _fixed()
    assert torch.equal(processed_logits(logits, Processing(temperature=0.5)), logits / 0.5)


def test_the_most_probable_token_is_always_kept() -> None:
    logits, _ = _fixed()
    keep = kept_support(logits, top_p=1e-6, min_p=1.0, top_k=1)
    assert torch.equal(keep.sum(-1), torch.ones(logits.shape[0], dtype=torch.long))
    assert torch.equal(keep.float().argmax(-1), logits.argmax(-1))


def test_seen_before_is_the_context_of_each_position() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7, 5], [3, 4, 9, 9, 2, 0]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    positions = torch.tensor([3, 4, 5])
    seen = seen_before(ids, attention, 12, positions)
    for b in range(2):
        for t, pos in enumerate(positions.tolist()):
            expected = {int(v) for v, a in zip(ids[b, : pos + 1], attention[b, : pos + 1]) if a}
            assert {v for v in range(12) if seen[b, t, v]} == expected
