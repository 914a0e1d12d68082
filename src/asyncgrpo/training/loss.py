"""The GRPO loss: pure tensor functions, no model, no optimizer (DESIGN.md §3 "Training").

Shapes: B sequences, T completion positions (a row holds one completion, right-padded),
V vocabulary entries. Every `[B, T]` tensor is aligned: position t of row b is completion
token t of sequence b.

Objectives (A: the sequence's advantage, broadcast over its tokens):
- `behaviour`: r = pi_theta / pi_gen; per-token loss
  -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A).
- `decoupled`: r = pi_theta / pi_prox clipped the same way, times the detached truncated
  importance weight w = min(pi_prox / pi_gen, is_cap).
- optional KL to a frozen reference: k3 = exp(ref - new) - (ref - new) - 1, times kl_coef,
  added per token.

Normalisation: `token` sums over every loss token and divides by `normalizer`, the number
of loss tokens of the whole optimizer-update batch; `sequence` sums each sequence's token
mean and divides by `normalizer`, the number of sequences with at least one loss token in
the update batch. Because the normaliser belongs to the update batch and not to the
micro-batch, summing the gradients of micro-batches equals the gradient of the whole batch.

Invariants:
- Positions outside `mask` contribute exactly nothing (value and gradient), whatever the
  padding holds.
- Log-ratios are clamped to +-20 before `exp`, so one wild token gives a large finite loss,
  never inf or NaN.
- Statistics are detached sums and counts (`LossStats`), so the trainer can merge them over
  micro-batches and updates without weighting mistakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Objective = Literal["behaviour", "decoupled"]
Normalization = Literal["token", "sequence"]

LOG_RATIO_CLAMP = 20.0


def token_logprobs(
    logits: Tensor, target_ids: Tensor, temperature: float = 1.0, *, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of `target_ids` under softmax(logits / temperature), and the entropy.

    logits `[B, T, V]` (any float dtype; computed in float32), target_ids `[B, T]` (int64).
    Returns (logp `[B, T]` float32 with grad, entropy `[B, T]` float32 detached, or None when
    `with_entropy` is False). The entropy is that of the same tempered distribution, in nats.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            detached = logp_all.detach()
            entropy = -(detached.exp() * detached).sum(-1)
    return logp, entropy


@dataclass
class TokenTerms:
    """Per-token pieces of the loss, all `[B, T]`, before masking and normalisation.

    `loss`: the per-token loss (policy term plus kl_coef * kl), with grad.
    `ratio`: the importance ratio reported as `is_ratio` (detached): pi_theta / pi_gen for
    `behaviour`, the untruncated pi_prox / pi_gen for `decoupled`.
    `clipped`: tokens whose clipped branch is active (no policy gradient): ratio above
    1 + clip_high with A > 0, or below 1 - clip_low with A < 0.
    `is_truncated`: tokens whose importance weight hit is_cap (`decoupled`; else all False).
    `kl`: the k3 estimate per token (detached), zeros without a reference.
    """

    loss: Tensor
    ratio: Tensor
    clipped: Tensor
    is_truncated: Tensor
    kl: Tensor


def _safe_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """a - b where mask holds, 0 elsewhere (padding never produces inf/NaN), clamped to +-20."""
    diff = torch.where(mask, a - b, torch.zeros_like(a))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def grpo_token_terms(
    logp_new: Tensor,
    logp_gen: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    objective: Objective = "behaviour",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    logp_prox: Tensor | None = None,
    is_cap: float = 2.0,
    logp_ref: Tensor | None = None,
    kl_coef: float = 0.0,
) -> TokenTerms:
    """Per-token loss terms. logp_* `[B, T]`, advantages `[B]` (one per sequence) or `[B, T]` (one per
    token: distillation, distill/loss.py), mask `[B, T]` (bool or 0/1).

    Only `logp_new` carries gradient; `logp_gen`, `logp_prox` and `logp_ref` are treated as
    constants (detached here).
    """
    mask = mask.bool()
    adv = advantages.detach().to(logp_new.dtype)
    adv = (adv if adv.dim() == 2 else adv.unsqueeze(-1)).expand_as(logp_new)
    logp_gen = logp_gen.detach().to(logp_new.dtype)
    if objective == "behaviour":
        ratio = torch.exp(_safe_log_ratio(logp_new, logp_gen, mask))
        weight = None
        reported = ratio.detach()
        is_truncated = torch.zeros_like(mask)
    elif objective == "decoupled":
        if logp_prox is None:
            raise ValueError("objective 'decoupled' needs logp_prox (the proximal log-probs computed at the start of the step)")
        logp_prox = logp_prox.detach().to(logp_new.dtype)
        ratio = torch.exp(_safe_log_ratio(logp_new, logp_prox, mask))
        raw_weight = torch.exp(_safe_log_ratio(logp_prox, logp_gen, mask))
        weight = raw_weight.clamp(max=is_cap)
        reported = raw_weight
        is_truncated = (raw_weight > is_cap) & mask
    else:
        raise ValueError(f"unknown objective {objective!r}: use 'behaviour' or 'decoupled'")

    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    policy = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if weight is not None:
        policy = policy * weight
    clipped = ((ratio.detach() > 1.0 + clip_high) & (adv > 0)) | ((ratio.detach() < 1.0 - clip_low) & (adv < 0))
    clipped = clipped & mask

    if logp_ref is not None:
        delta = _safe_log_ratio(logp_ref.detach().to(logp_new.dtype), logp_new, mask)
        kl = torch.exp(delta) - delta - 1.0
        loss = policy + kl_coef * kl if kl_coef else policy
        kl_detached = kl.detach()
    else:
        if kl_coef:
            raise ValueError(f"kl_coef = {kl_coef} needs logp_ref (log-probs of the frozen reference model)")
        loss = policy
        kl_detached = torch.zeros_like(policy.detach())
    return TokenTerms(loss=loss, ratio=reported, clipped=clipped, is_truncated=is_truncated, kl=kl_detached)


@dataclass
class LossStats:
    """Detached sums over the loss tokens of one or more micro-batches; merge with `+`.

    Stored as 0-d tensors on the computing device (no host sync per micro-batch); the
    properties turn them into floats. With no loss token every mean is 0.0.
    """

    tokens: Tensor
    clipped: Tensor
    ratio_sum: Tensor
    ratio_max: Tensor
    is_truncated: Tensor
    kl_sum: Tensor
    entropy_sum: Tensor

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu") -> LossStats:
        z = torch.zeros((), dtype=torch.float64, device=device)
        return cls(z, z, z, z, z, z, z)

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            tokens=self.tokens + other.tokens,
            clipped=self.clipped + other.clipped,
            ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_max=torch.maximum(self.ratio_max, other.ratio_max),
            is_truncated=self.is_truncated + other.is_truncated,
            kl_sum=self.kl_sum + other.kl_sum,
            entropy_sum=self.entropy_sum + other.entropy_sum,
        )

    def _mean(self, total: Tensor) -> float:
        n = float(self.tokens)
        return float(total) / n if n > 0 else 0.0

    @property
    def clip_frac(self) -> float:
        return self._mean(self.clipped)

    @property
    def is_ratio_mean(self) -> float:
        return self._mean(self.ratio_sum)

    @property
    def is_ratio_max(self) -> float:
        return float(self.ratio_max)

    @property
    def is_truncated_frac(self) -> float:
        return self._mean(self.is_truncated)

    @property
    def kl_mean(self) -> float:
        return self._mean(self.kl_sum)

    @property
    def entropy_mean(self) -> float:
        return self._mean(self.entropy_sum)


def grpo_loss(
    logp_new: Tensor,
    logp_gen: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normalizer: float,
    *,
    objective: Objective = "behaviour",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    logp_prox: Tensor | None = None,
    is_cap: float = 2.0,
    logp_ref: Tensor | None = None,
    kl_coef: float = 0.0,
    normalization: Normalization = "token",
    entropy: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """The loss of one micro-batch, scaled for gradient accumulation over its update batch.

    logp_new/logp_gen/logp_prox/logp_ref `[B, T]`, advantages `[B]` or `[B, T]`, mask `[B, T]` (1 on the
    completion tokens that count; prompt, padding and masked-out completions 0), entropy
    `[B, T]` (statistics only, optional). `normalizer` (> 0): the update batch's loss tokens
    (`token`) or its sequences with at least one loss token (`sequence`).

    Returns (scalar loss with grad, detached `LossStats`).
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (loss tokens or sequences of the update batch), got {normalizer}")
    if logp_new.dim() != 2 or logp_gen.shape != logp_new.shape or mask.shape != logp_new.shape:
        raise ValueError(
            f"grpo_loss needs aligned [B, T] tensors: logp_new {tuple(logp_new.shape)}, "
            f"logp_gen {tuple(logp_gen.shape)}, mask {tuple(mask.shape)}"
        )
    if advantages.shape not in (logp_new.shape[:1], logp_new.shape):
        raise ValueError(
            f"advantages must be [B] = {tuple(logp_new.shape[:1])} or [B, T] = {tuple(logp_new.shape)}, got {tuple(advantages.shape)}"
        )
    mask = mask.bool()
    terms = grpo_token_terms(
        logp_new,
        logp_gen,
        advantages,
        mask,
        objective=objective,
        clip_low=clip_low,
        clip_high=clip_high,
        logp_prox=logp_prox,
        is_cap=is_cap,
        logp_ref=logp_ref,
        kl_coef=kl_coef,
    )
    masked = torch.where(mask, terms.loss, torch.zeros_like(terms.loss))
    if normalization == "token":
        loss = masked.sum() / normalizer
    elif normalization == "sequence":
        per_seq_tokens = mask.sum(-1).clamp(min=1).to(masked.dtype)
        loss = (masked.sum(-1) / per_seq_tokens).sum() / normalizer
    else:
        raise ValueError(f"unknown normalization {normalization!r}: use 'token' or 'sequence'")

    with torch.no_grad():
        f = mask.to(torch.float64)
        ratio = terms.ratio.to(torch.float64)
        ratio_max = (ratio * f).amax() if ratio.numel() else torch.zeros((), dtype=torch.float64, device=ratio.device)
        stats = LossStats(
            tokens=f.sum(),
            clipped=terms.clipped.to(torch.float64).sum(),
            ratio_sum=(ratio * f).sum(),
            ratio_max=ratio_max,
            is_truncated=terms.is_truncated.to(torch.float64).sum(),
            kl_sum=(terms.kl.to(torch.float64) * f).sum(),
            entropy_sum=(entropy.detach().to(torch.float64) * f).sum() if entropy is not None else f.sum() * 0,
        )
    return loss, stats
