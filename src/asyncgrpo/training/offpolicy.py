"""Off-policy diagnostics of one training step: is it staleness or the engine? (DESIGN.md §5, docs/troubleshooting.md)

Job: collect, for every loss token of a step, the behaviour importance ratio r = pi_theta / pi_gen of the
weights at the start of the step against the generator's logprob, the token's staleness (the step's
version minus the version that generated it) and its advantage's sign; turn them into per-step metrics:

- per staleness value s in 0..K (`offpolicy/s{s}/...`; K: rollout.trained_staleness_bound): `tokens`, `clip_frac` (r outside
  [1 - clip_low, 1 + clip_high] on the side PPO clips: above with A > 0, below with A < 0; the loss's own
  clip_frac under objective behaviour), `is_ratio/mean`, `is_ratio/p1`, `is_ratio/p99`, `masked_frac`
  (tokens that get no weight: outside the current policy's sampling support, or masked by `masked`), and
  `ess` (the normalised effective sample size of the ratios, (sum r)^2 / (n sum r^2), in (0, 1]);
- the engine mismatch, measured on the staleness-0 tokens only (`engine_mismatch/...`): `logp_abs_mean`,
  `logp_abs_max` (|log pi_trainer - log pi_engine| of the same weights) and `kl` (the k3 estimate of
  KL(engine || trainer) from the engine's samples). A perfect engine gives 0 whatever the staleness, so
  drift at s >= 1 beyond the s = 0 row is staleness, and a bad s = 0 row is the engine.

An empty bucket reports `tokens` 0 and NaN for its other keys (null in metrics.jsonl).

Invariants:
- Only logprobs of the step-start weights are observed (the trainer passes the first update's pi_theta,
  or pi_prox of later updates under `decoupled`), so a ratio never mixes in the step's own updates.
- Log-ratios are clamped to +-20 like the loss's, so a token outside the support counts (r = e^-20) and
  nothing is inf.
- Under data parallelism a rank observes its own share of the batch; `metrics(gather=...)` puts every rank's
  records together first (a collective: every rank calls it), so the metrics are the whole batch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from asyncgrpo.metric_names import ENGINE_MISMATCH_KEYS as MISMATCH_KEYS
from asyncgrpo.metric_names import OFFPOLICY_BUCKET_KEYS as BUCKET_KEYS
from asyncgrpo.sampling import LOG_RATIO_CLAMP


class OffPolicyStats:
    """Per-token records of one step; `observe` per micro-batch, `metrics` once at the end."""

    def __init__(self, max_staleness: int, *, clip_low: float, clip_high: float) -> None:
        self.max_staleness = max_staleness
        self.clip_low, self.clip_high = clip_low, clip_high
        self._parts: list[Tensor] = []  # each [4, n] float64: log-ratio, staleness, clipped, zero-weight

    @torch.no_grad()
    def observe(self, logp_start: Tensor, logp_gen: Tensor, advantages: Tensor, mask: Tensor, staleness: Tensor,
                masked: Tensor | None = None) -> None:
        """logp_start / logp_gen / mask / staleness `[B, T]`, advantages `[B]` or `[B, T]`, masked (optional) `[B, T]`:
        tokens a correction gave no weight, on top of those outside the support (logp_start = -inf)."""
        keep = mask.bool()
        adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(logp_start)
        outside = torch.isneginf(logp_start)
        log_ratio = (logp_start.double() - logp_gen.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()
        clipped = ((ratio > 1 + self.clip_high) & (adv > 0)) | ((ratio < 1 - self.clip_low) & (adv < 0))
        zero = outside if masked is None else outside | masked.bool()
        rows = torch.stack([log_ratio, staleness.double(), clipped.double(), zero.double()])
        self._parts.append(rows[:, keep].cpu())

    def metrics(self, gather: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """Every key of `metric_names.offpolicy_keys(max_staleness)`; `gather`: the data-parallel ranks' records
        side by side (`RankShare.gather_rows`), None in a single process."""
        rows = torch.cat(self._parts, dim=1) if self._parts else torch.zeros(4, 0, dtype=torch.float64)
        if gather is not None:
            rows = gather(rows)
        log_ratio, staleness, clipped, zero = rows.unbind()
        out: dict[str, float] = {}
        for s in range(self.max_staleness + 1):
            sel = staleness == s
            n = int(sel.sum())
            prefix = f"offpolicy/s{s}/"
            if n == 0:
                out.update({prefix + key: (0.0 if key == "tokens" else math.nan) for key in BUCKET_KEYS})
                continue
            r = log_ratio[sel].exp()
            p1, p99 = torch.quantile(r, torch.tensor([0.01, 0.99], dtype=r.dtype)).tolist()
            out.update({
                prefix + "tokens": float(n),
                prefix + "clip_frac": float(clipped[sel].mean()),
                prefix + "is_ratio/mean": float(r.mean()),
                prefix + "is_ratio/p1": p1,
                prefix + "is_ratio/p99": p99,
                prefix + "masked_frac": float(zero[sel].mean()),
                prefix + "ess": float(r.sum() ** 2 / (n * (r**2).sum())),
            })
        fresh = log_ratio[staleness == 0]
        if fresh.numel():
            out.update({
                "engine_mismatch/tokens": float(fresh.numel()),
                "engine_mismatch/logp_abs_mean": float(fresh.abs().mean()),
                "engine_mismatch/logp_abs_max": float(fresh.abs().max()),
                "engine_mismatch/kl": float((fresh.exp() - fresh - 1).mean()),
            })
        else:
            out.update({key: (0.0 if key.endswith("/tokens") else math.nan) for key in MISMATCH_KEYS})
        return out
