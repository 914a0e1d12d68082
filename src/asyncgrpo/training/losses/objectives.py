"""The per-token policy term of each built-in `train.loss.type`, TRL 1.16's formulas (docs/losses.md).

Inputs, all aligned `[B, T]` (a sequence-level ratio is broadcast over its row): `logp` (pi_theta, with grad),
`log_ratio` the per-token log of pi_theta over the ratio's anchor (pi_gen or pi_prox, training/loss.py), `ratio`
the ratio at `train.loss.importance_sampling_level` (TRL's coef_1), `adv` the advantages, `mask` the loss tokens,
`weight` the detached off-policy weight (corrections.py) or None.

- grpo, dr_grpo, dapo, bnpo, luspo: PPO-clip, -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A).
- cispo: -min(r, cispo_clip_max) A log pi_theta, the clipped ratio detached (MiniMax-M1).
- sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_temperature_pos for A > 0, else sapo_temperature_neg.
- vespo: -phi(w) A log pi_theta with phi detached, w the sequence's product of per-token ratios (times the
  off-policy weights), phi(w) = exp(lambda + k log w - lambda w), (k, lambda) by the sign of A.

Each returns (per-token loss, clipped, weighted): `clipped` marks tokens with no policy gradient from the clip
(False for the soft gates), `weighted` whether `weight` is already inside the term (VESPO) so the caller must
not multiply it again. Invariant: the value and gradient outside `mask` never reach the loss (the caller masks),
and nothing here produces inf or NaN from padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from asyncgrpo.loss_config import PPO_CLIP_TYPES, LossConfig
from asyncgrpo.sampling import LOG_RATIO_CLAMP

VESPO_LOG_FLOOR = math.log(1e-8)


def policy_term(
    loss_type: str, logp: Tensor, log_ratio: Tensor, ratio: Tensor, adv: Tensor, mask: Tensor, weight: Tensor | None, cfg: LossConfig
) -> tuple[Tensor, Tensor, bool]:
    if loss_type in PPO_CLIP_TYPES:
        return _ppo_clip(ratio, adv, cfg) + (False,)
    if loss_type == "cispo":
        capped = ratio.clamp(max=cfg.cispo_clip_max).detach()
        return -capped * adv * logp, (ratio.detach() > cfg.cispo_clip_max) & (adv > 0), False
    if loss_type == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_temperature_pos), torch.full_like(adv, cfg.sapo_temperature_neg))
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv, torch.zeros_like(mask), False
    if loss_type == "vespo":
        phi = vespo_weight(log_ratio, adv, mask, weight, cfg)
        return -phi * adv * logp, torch.zeros_like(mask), True
    raise ValueError(f"unknown loss type {loss_type!r}")


def _ppo_clip(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    r = ratio.detach()
    clipped = ((r > 1.0 + cfg.clip_high) & (adv > 0)) | ((r < 1.0 - cfg.clip_low) & (adv < 0))
    return loss, clipped


@torch.no_grad()
def vespo_weight(log_ratio: Tensor, adv: Tensor, mask: Tensor, weight: Tensor | None, cfg: LossConfig) -> Tensor:
    """phi(w) `[B, 1]` (or `[B, T]` with per-token advantages), detached; log w sums the clamped per-token
    log-ratios over `mask` and the logs of the off-policy weights (floored at 1e-8, so a masked-out weight of 0
    sends phi to 0)."""
    log_w = torch.where(mask, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
    if weight is not None:
        log_w = log_w + torch.log(weight).clamp(VESPO_LOG_FLOOR, LOG_RATIO_CLAMP).sum(-1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, cfg.vespo_k_pos), torch.full_like(adv, cfg.vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(adv, cfg.vespo_lambda_pos), torch.full_like(adv, cfg.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
