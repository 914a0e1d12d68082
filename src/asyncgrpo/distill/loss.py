"""The distillation signal as per-token advantages for the GRPO loss (training/loss.py). Pure tensors.

Per token t of a sample, A_t = -(log pi_gen(x_t) - log pi_teacher(x_t)): minus the sampled-token estimate of
the reverse KL KL(pi || pi_teacher) (on-policy distillation as in Agarwal et al. 2024 and Thinking Machines'
"On-Policy Distillation", with discount 0: each token is its own reward). The GRPO loss
-min(r A, clip(r) A) with r = pi_theta / pi_gen (or the decoupled pi_prox form) then trains on them: at r = 1
its gradient is -sum_t A_t grad log pi_theta(x_t), which is the score-function gradient of the reverse KL
(E_pi[(log pi - log pi_teacher) grad log pi], the other term having expectation 0), so a descent step lowers
the KL. Staleness is corrected exactly as for GRPO, by the same importance ratio against pi_gen.

Why not differentiate log pi_theta - log pi_teacher directly: on tokens sampled from pi its gradient is
E_pi[grad log pi] = 0 in expectation, so it carries no signal about which tokens the teacher prefers.

Invariants: positions outside `mask` are 0; values are clamped to +-LOG_RATIO_CLAMP, so a token the teacher
finds impossible gives a large finite advantage, never inf or NaN; the result carries no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncgrpo.sampling import LOG_RATIO_CLAMP


def distill_advantages(logp_gen: Tensor, logp_teacher: Tensor, mask: Tensor) -> Tensor:
    """A `[B, T]` = -(logp_gen - logp_teacher) on `mask`, 0 elsewhere; all three `[B, T]`."""
    if logp_gen.shape != logp_teacher.shape or mask.shape != logp_gen.shape:
        raise ValueError(
            f"distill_advantages needs aligned [B, T] tensors: logp_gen {tuple(logp_gen.shape)}, "
            f"logp_teacher {tuple(logp_teacher.shape)}, mask {tuple(mask.shape)}"
        )
    with torch.no_grad():
        diff = torch.where(mask.bool(), logp_teacher.float() - logp_gen.float(), torch.zeros_like(logp_gen, dtype=torch.float32))
        return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
