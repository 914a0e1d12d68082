"""GRPO loss: hand-computed per-token values for both objectives, KL, normalisation, and
micro-batch accumulation equal to the full-batch gradient."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.loss_config import LossConfig
from asyncgrpo.sampling import token_logprobs
from asyncgrpo.training.loss import LossStats, grpo_loss, grpo_token_terms

LN = math.log


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_token_logprobs_and_entropy_at_temperature():
    logits = torch.tensor([[[0.0, LN(3.0)], [LN(3.0), 0.0]]])  # [1, 2, 2]
    targets = torch.tensor([[1, 1]])
    logp, ent = token_logprobs(logits, targets, temperature=1.0)
    assert logp.shape == (1, 2) and ent.shape == (1, 2)
    assert logp[0].tolist() == pytest.approx([LN(0.75), LN(0.25)], abs=1e-6)
    h = -(0.25 * LN(0.25) + 0.75 * LN(0.75))
    assert ent[0].tolist() == pytest.approx([h, h], abs=1e-6)
    # Temperature 2: logits halved, so p = [1, sqrt 3] / (1 + sqrt 3).
    logp2, ent2 = token_logprobs(logits, targets, temperature=2.0)
    s3 = math.sqrt(3.0)
    p = [1 / (1 + s3), s3 / (1 + s3)]
    assert float(logp2[0, 0]) == pytest.approx(LN(p[1]), abs=1e-6)
    assert float(ent2[0, 0]) == pytest.approx(-(p[0] * LN(p[0]) + p[1] * LN(p[1])), abs=1e-6)
    assert not ent2.requires_grad
    _, none = token_logprobs(logits, targets, 1.0, with_entropy=False)
    assert none is None


def _behaviour_case():
    # Ratios pi_new / pi_gen chosen per token; A = +2 for row 0, -1 for row 1.
    ratios = [[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]]
    logp_gen = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp_new = _leaf([[-1.0 + LN(r) for r in row] for row in ratios])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp_new, logp_gen, adv, mask


def test_behaviour_per_token_values_and_clipping():
    logp_new, logp_gen, adv, mask = _behaviour_case()
    terms = grpo_token_terms(logp_new, logp_gen, adv, mask, loss=LossConfig(objective="behaviour", clip_low=0.2, clip_high=0.28))
    # row 0 (A=+2): r=1 -> -2; r=1.5 clipped high -> -1.28*2; r=0.5 (not clipped for A>0) -> -1.0
    # row 1 (A=-1): r=0.5 clipped low -> -(0.8 * -1) = 0.8; r=1.5 -> 1.5
    assert terms.loss[0].tolist() == pytest.approx([-2.0, -2.56, -1.0], abs=1e-9)
    assert terms.loss[1, :2].tolist() == pytest.approx([0.8, 1.5], abs=1e-9)
    assert terms.clipped.tolist() == [[False, True, False], [True, False, False]]

    loss, stats = grpo_loss(logp_new, logp_gen, adv, mask, normalizer=5, loss=LossConfig(objective="behaviour", clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx((-2 - 2.56 - 1.0 + 0.8 + 1.5) / 5, abs=1e-9)
    assert stats.clip_frac == pytest.approx(2 / 5)
    assert stats.is_ratio_mean == pytest.approx((1 + 1.5 + 0.5 + 0.5 + 1.5) / 5)
    assert stats.is_ratio_max == pytest.approx(1.5)
    assert stats.kl_mean == 0.0
    loss.backward()
    # d/d logp_new of -r*A is -A*r; clipped and masked tokens get none.
    expected = [[-2 * 1.0 / 5, 0.0, -2 * 0.5 / 5], [0.0, 1.5 / 5, 0.0]]
    assert logp_new.grad.tolist() == [pytest.approx(row, abs=1e-9) for row in expected]


def test_sequence_normalisation():
    logp_new, logp_gen, adv, mask = _behaviour_case()
    loss, _ = grpo_loss(logp_new, logp_gen, adv, mask, normalizer=2, loss=LossConfig(normalization="sequence"))
    seq0 = (-2 - 2.56 - 1.0) / 3
    seq1 = (0.8 + 1.5) / 2
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-9)
    # Each sequence weighs the same whatever its length.
    loss.backward()
    assert float(logp_new.grad[1, 1]) == pytest.approx(1.5 / 2 / 2, abs=1e-9)
    assert float(logp_new.grad[0, 0]) == pytest.approx(-2.0 / 3 / 2, abs=1e-9)


def test_decoupled_per_token_values_clip_and_is_cap():
    # Per token: (pi_prox / pi_gen, pi_new / pi_prox)
    row0 = [(3.0, 1.0), (0.5, 1.5), (1.0, 0.9)]  # A = +1
    row1 = [(1.5, 0.5), (1.0, 1.2), (2.5, 1.0)]  # A = -2
    gen = torch.full((2, 3), -2.0, dtype=torch.float64)
    prox_values = [[-2.0 + LN(w) for w, _ in row] for row in (row0, row1)]
    prox = _leaf(prox_values)
    new = _leaf([[prox_values[i][j] + LN(r) for j, (_, r) in enumerate(row)] for i, row in enumerate((row0, row1))])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    terms = grpo_token_terms(new, gen, adv, mask, loss=LossConfig(objective="decoupled", clip_low=0.2, clip_high=0.28, is_cap=2.0), logp_prox=prox)
    # row 0: w=min(3,2)=2, r=1 -> -2; w=.5, r=1.5 clipped -> -1.28*.5; w=1, r=.9 -> -.9
    # row 1: w=1.5, r=.5 clipped low -> 0.8*2*1.5; w=1, r=1.2 -> 2.4; w=min(2.5,2)=2, r=1 -> 4
    assert terms.loss[0].tolist() == pytest.approx([-2.0, -0.64, -0.9], abs=1e-9)
    assert terms.loss[1].tolist() == pytest.approx([2.4, 2.4, 4.0], abs=1e-9)
    assert terms.clipped.tolist() == [[False, True, False], [True, False, False]]
    assert terms.is_truncated.tolist() == [[True, False, False], [False, False, True]]

    loss, stats = grpo_loss(new, gen, adv, mask, 6, loss=LossConfig(objective="decoupled", is_cap=2.0), logp_prox=prox)
    assert loss.item() == pytest.approx((-2 - 0.64 - 0.9 + 2.4 + 2.4 + 4.0) / 6, abs=1e-9)
    # is_ratio reports the untruncated pi_prox / pi_gen.
    assert stats.is_ratio_mean == pytest.approx((3 + 0.5 + 1 + 1.5 + 1 + 2.5) / 6)
    assert stats.is_ratio_max == pytest.approx(3.0)
    assert stats.clip_frac == pytest.approx(2 / 6)
    assert stats.is_truncated_frac == pytest.approx(2 / 6)
    loss.backward()
    # The weight is detached: gradient -A * r * w for unclipped tokens, none to prox.
    assert prox.grad is None
    assert float(new.grad[0, 0]) == pytest.approx(-1 * 1.0 * 2.0 / 6, abs=1e-9)
    assert float(new.grad[0, 1]) == 0.0
    assert float(new.grad[1, 2]) == pytest.approx(2 * 1.0 * 2.0 / 6, abs=1e-9)


def test_decoupled_needs_prox():
    logp_new, logp_gen, adv, mask = _behaviour_case()
    with pytest.raises(ValueError, match="logp_prox"):
        grpo_loss(logp_new, logp_gen, adv, mask, 5, loss=LossConfig(objective="decoupled"))


def test_kl_k3_value_and_gradient():
    # A = 0 silences the policy term; ref - new = ln 2 and -0.5.
    new = _leaf([[-1.0, -1.0]])
    ref = torch.tensor([[-1.0 + LN(2.0), -1.5]], dtype=torch.float64)
    gen = new.detach().clone()
    adv = torch.zeros(1, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    k = [2.0 - LN(2.0) - 1.0, math.exp(-0.5) + 0.5 - 1.0]
    loss, stats = grpo_loss(new, gen, adv, mask, 2, logp_ref=ref, loss=LossConfig(kl_coef=0.1))
    assert stats.kl_mean == pytest.approx(sum(k) / 2, abs=1e-9)
    assert loss.item() == pytest.approx(0.1 * sum(k) / 2, abs=1e-9)
    loss.backward()
    # d k3 / d new = 1 - exp(ref - new)
    assert new.grad[0].tolist() == pytest.approx([0.1 * (1 - 2.0) / 2, 0.1 * (1 - math.exp(-0.5)) / 2], abs=1e-9)


def test_kl_coef_without_reference_is_an_error():
    logp_new, logp_gen, adv, mask = _behaviour_case()
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp_new, logp_gen, adv, mask, 5, loss=LossConfig(kl_coef=0.1))


def test_padding_garbage_is_ignored():
    logp_new, logp_gen, adv, mask = _behaviour_case()
    logp_gen = logp_gen.clone()
    logp_gen[1, 2] = float("-inf")
    with torch.no_grad():
        logp_new[1, 2] = float("nan")
    loss, stats = grpo_loss(logp_new, logp_gen, adv, mask, 5)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(stats.is_ratio_max)
    assert float(logp_new.grad[1, 2]) == 0.0


def test_wild_ratio_stays_finite():
    new = _leaf([[0.0]])
    gen = torch.tensor([[-500.0]], dtype=torch.float64)
    loss, _ = grpo_loss(new, gen, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool), 1)
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("objective", ["behaviour", "decoupled"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_micro_batch_accumulation_equals_full_batch(objective, normalization):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    base = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    gen = base + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    prox = base + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = base + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = [5, 3, 1, 4, 2, 5]
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    mask[3] = False  # a masked-out (e.g. truncated) sequence
    kwargs = dict(loss=LossConfig(objective=objective, clip_low=0.2, clip_high=0.28, is_cap=2.0, kl_coef=0.05, normalization=normalization))
    normalizer = int(mask.sum()) if normalization == "token" else int((mask.sum(-1) > 0).sum())

    full = base.clone().requires_grad_(True)
    loss_full, stats_full = grpo_loss(full, gen, adv, mask, normalizer, logp_prox=prox, logp_ref=ref, **kwargs)
    loss_full.backward()

    micro = base.clone().requires_grad_(True)
    total, stats = 0.0, LossStats.zeros()
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        loss, st = grpo_loss(micro[rows], gen[rows], adv[rows], mask[rows], normalizer, logp_prox=prox[rows], logp_ref=ref[rows], **kwargs)
        loss.backward()
        total += loss.item()
        stats = stats + st
    assert total == pytest.approx(loss_full.item(), abs=1e-12)
    torch.testing.assert_close(micro.grad, full.grad, rtol=0, atol=1e-12)
    assert stats.clip_frac == pytest.approx(stats_full.clip_frac)
    assert stats.is_ratio_mean == pytest.approx(stats_full.is_ratio_mean)
    assert stats.is_ratio_max == pytest.approx(stats_full.is_ratio_max)
    assert stats.kl_mean == pytest.approx(stats_full.kl_mean)
