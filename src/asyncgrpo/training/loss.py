"""The GRPO loss: pure tensor functions, no model, no optimizer (DESIGN.md §3 "Training", docs/losses.md).

Shapes: B sequences, T completion positions (a row holds one completion, right-padded),
V vocabulary entries. Every `[B, T]` tensor is aligned: position t of row b is completion
token t of sequence b.

The ratio (TRL's coef_1): r = pi_theta / pi_anchor, per token or (`importance_sampling_level:
sequence`, GSPO) the exponential of the sequence's mean log-ratio. The anchor is the staleness
correction (`train.loss.objective`):
- `behaviour`: pi_gen, the generator's log-probs; no weight.
- `decoupled`: pi_prox, the trainer's log-probs of the weights the step started from, times the
  detached weight pi_prox / pi_gen (training/losses/corrections.py: truncated at is_cap, or shaped
  by the mismatch correction where it is mismatch alone).
`train.loss.type` turns r into the per-token policy term (training/losses/objectives.py) or calls
a plug-in (training/losses/plugin.py); the weight multiplies it (VESPO folds it in itself); an
optional KL to a frozen reference, k3 = exp(ref - new) - (ref - new) - 1, times kl_coef, is added
per token; the type's aggregation (training/losses/aggregation.py) divides by `normalizer`, which
belongs to the whole optimizer update, so summing the gradients of micro-batches equals the
gradient of the whole batch.

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

import torch
from torch import Tensor

from asyncgrpo.loss_config import LossConfig
from asyncgrpo.sampling import LOG_RATIO_CLAMP
from asyncgrpo.training.losses.aggregation import aggregate
from asyncgrpo.training.losses.corrections import off_policy_weight
from asyncgrpo.training.losses.objectives import policy_term
from asyncgrpo.training.losses.plugin import LossBatch, LossFunction, call_plugin

DEFAULT_LOSS = LossConfig()


@dataclass
class TokenTerms:
    """Per-token pieces of the loss, all `[B, T]`, before masking and normalisation.

    `loss`: the per-token loss (policy term plus kl_coef * kl), with grad.
    `ratio`: the importance ratio reported as `is_ratio` (detached): pi_theta / pi_gen for
    `behaviour`, the untruncated pi_prox / pi_gen for `decoupled`.
    `clipped`: tokens whose clipped branch is active (no policy gradient): PPO-clip's ratio above
    1 + clip_high with A > 0, or below 1 - clip_low with A < 0; cispo's above cispo_clip_max with A > 0.
    `is_truncated`: tokens whose weight pi_prox / pi_gen was truncated or masked (`decoupled`; else all False).
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
    loss: LossConfig = DEFAULT_LOSS,
    logp_prox: Tensor | None = None,
    logp_ref: Tensor | None = None,
    staleness: Tensor | None = None,
    plugin: LossFunction | None = None,
) -> TokenTerms:
    """Per-token loss terms. logp_* `[B, T]`, advantages `[B]` (one per sequence) or `[B, T]` (one per
    token: distillation, distill/loss.py), mask `[B, T]` (bool or 0/1), staleness `[B, T]` (the trainer's
    version minus each token's; None: all 0), `plugin` the function `loss.type` names when it is one.

    Only `logp_new` carries gradient; `logp_gen`, `logp_prox` and `logp_ref` are treated as
    constants (detached here).
    """
    mask = mask.bool()
    adv = advantages.detach().to(logp_new.dtype)
    adv = (adv if adv.dim() == 2 else adv.unsqueeze(-1)).expand_as(logp_new)
    logp_gen = logp_gen.detach().to(logp_new.dtype)
    staleness = torch.zeros_like(mask, dtype=torch.long) if staleness is None else staleness
    weight = None
    if loss.objective == "decoupled":
        if logp_prox is None:
            raise ValueError("objective 'decoupled' needs logp_prox (the proximal log-probs computed at the start of the step)")
        logp_prox = logp_prox.detach().to(logp_new.dtype)
        log_rho = _safe_log_ratio(logp_prox, logp_gen, mask)
        weight, is_truncated = off_policy_weight(log_rho, mask, staleness, loss)
        reported = torch.exp(log_rho)
        anchor = logp_prox
    elif loss.objective == "behaviour":
        anchor, is_truncated = logp_gen, torch.zeros_like(mask)
    else:
        raise ValueError(f"unknown objective {loss.objective!r}: use 'behaviour' or 'decoupled'")
    log_ratio = _safe_log_ratio(logp_new, anchor, mask)
    if loss.importance_sampling_level == "sequence":  # GSPO: the mean log-ratio of the sequence, on each of its tokens
        seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        ratio = torch.exp(seq).expand_as(log_ratio)
    else:
        ratio = torch.exp(log_ratio)
    if loss.objective == "behaviour":
        reported = ratio.detach()

    if loss.plugin:
        if plugin is None:
            raise ValueError(f"train.loss.type = {loss.type!r} is a plug-in: pass the function it names (training/losses/plugin.py)")
        batch = LossBatch(logp_new, logp_gen, logp_prox, adv, mask, staleness, loss.clip_low, loss.clip_high)
        policy, clipped, weighted = call_plugin(plugin, loss.type, batch), torch.zeros_like(mask), False
    else:
        policy, clipped, weighted = policy_term(loss.type, logp_new, log_ratio, ratio, adv, mask, weight, loss)
    if weight is not None and not weighted:
        policy = policy * weight
    clipped = clipped & mask

    if logp_ref is not None:
        delta = _safe_log_ratio(logp_ref.detach().to(logp_new.dtype), logp_new, mask)
        kl = torch.exp(delta) - delta - 1.0
        total = policy + loss.kl_coef * kl if loss.kl_coef else policy
        kl_detached = kl.detach()
    else:
        if loss.kl_coef:
            raise ValueError(f"kl_coef = {loss.kl_coef} needs logp_ref (log-probs of the frozen reference model)")
        total = policy
        kl_detached = torch.zeros_like(policy.detach())
    return TokenTerms(loss=total, ratio=reported, clipped=clipped, is_truncated=is_truncated, kl=kl_detached)


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
    loss: LossConfig = DEFAULT_LOSS,
    logp_prox: Tensor | None = None,
    logp_ref: Tensor | None = None,
    staleness: Tensor | None = None,
    entropy: Tensor | None = None,
    plugin: LossFunction | None = None,
) -> tuple[Tensor, LossStats]:
    """The loss of one micro-batch, scaled for gradient accumulation over its update batch.

    logp_new/logp_gen/logp_prox/logp_ref `[B, T]`, advantages `[B]` or `[B, T]`, mask `[B, T]` (1 on the
    completion tokens that count; prompt, padding and masked-out completions 0), staleness `[B, T]`,
    entropy `[B, T]` (statistics only, optional). `normalizer` (> 0): the update's, for `loss.aggregation`
    (training/losses/aggregation.py `update_normalizer`).

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
        logp_new, logp_gen, advantages, mask, loss=loss, logp_prox=logp_prox, logp_ref=logp_ref, staleness=staleness, plugin=plugin
    )
    total = aggregate(terms.loss, mask, loss.aggregation, normalizer)

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
    return total, stats
