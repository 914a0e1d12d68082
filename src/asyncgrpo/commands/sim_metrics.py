"""The simulator's token-level metrics (`simulate --json`): what a run trained against what it could have. Pure.

Honest against length bias: a rollouts-per-second bound rewards a policy that trains the short
(fast) completions and cancels the long ones, so these count tokens, and compare the trained
completions with the population the policy asked for. That population is `drawn_lengths`: per
prompt id, the length of every attempt the generator was asked for, finished or cancelled
(generation/scripted.py); each prompt weighs the same, so requeued (often long) prompts do not
count twice.

- `token_efficiency` = trained tokens/s / min(generation capacity, training capacity), both in
  tokens/s with the population's mean length L: generation = max_inflight * L / E[latency]
  (token model: E[latency] = prefill_s + L * decode_s_per_token * max(1, max_inflight / batch_knee),
  exact for a server kept full), training = 1 / simulate.token_time_s, or groups_per_step *
  group_size * L / step_time_s with fixed-time steps.
- `goodput`: share of generator time (rollouts' start to end) that ended in trained tokens.
- `wasted_tokens`: finished completions' tokens thrown away, by reason (stale, failed, filtered).
- `length_bias` = trained completions' mean length / L (1.0: no bias; below: short answers favoured).
- `stale_drops_by_length_quartile`: per quartile of prompt length (shortest first), the share of
  the prompts' takes that ended dropped as stale.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.distributions import mean_of
from asyncgrpo.metric_names import WASTE_REASONS


def population_length(drawn_lengths: Mapping[int, Sequence[int]]) -> float | None:
    """Mean completion length the policy asked for: per prompt the mean of its attempts, then over prompts."""
    per_prompt = [statistics.fmean(lengths) for lengths in drawn_lengths.values() if lengths]
    return statistics.fmean(per_prompt) if per_prompt else None


def token_capacities(cfg: Config, length: float) -> tuple[float, float]:
    """(generation, training) capacity in tokens/s for completions of mean length `length` (math.inf: free)."""
    g, scripted, r = cfg.generation, cfg.simulate, cfg.rollout
    model = scripted.token_model
    if model is None:
        latency = mean_of(scripted.latency_s)
    else:
        latency = model.prefill_s + length * model.decode_s_per_token * max(1.0, g.max_inflight / model.batch_knee)
    generation = g.max_inflight * length / latency if latency > 0 else math.inf
    if cfg.simulate.token_time_s is not None:  # a step: step_overhead_s + token_time_s x its tokens
        training = 1 / (cfg.simulate.token_time_s + cfg.simulate.step_overhead_s / (r.groups_per_step * r.group_size * length))
    else:
        training = r.groups_per_step * r.group_size * length / cfg.simulate.step_time_s
    return generation, training


def token_metrics(
    cfg: Config,
    counters: Mapping[str, int],
    drawn_lengths: Mapping[int, Sequence[int]],
    outcomes: Sequence[Mapping[str, Any]],
    virtual_time_s: float,
) -> dict[str, Any]:
    """The token-level part of the report; None where nothing was drawn (a test's own generator)."""
    trained_tokens = counters["rollout/trained_tokens_total"]
    trained_completions = counters["rollout/trained_completions_total"]
    trained_len = trained_tokens / trained_completions if trained_completions else None
    length = population_length(drawn_lengths)
    efficiency = bias = None
    generation = training = None
    if length is not None:
        generation, training = token_capacities(cfg, length)
        bound = min(generation, training)
        efficiency = trained_tokens / virtual_time_s / bound if virtual_time_s > 0 and bound > 0 else 0.0
        bias = trained_len / length if trained_len is not None else None
    generation_ms = counters["rollout/generation_ms_total"]
    return {
        "token_efficiency": _round(efficiency),
        "goodput": _round(counters["rollout/trained_generation_ms_total"] / generation_ms if generation_ms else None),
        "length_bias": _round(bias),
        "trained_tokens": trained_tokens,
        "trained_len_mean": _round(trained_len),
        "population_len_mean": _round(length),
        "wasted_tokens": {reason: counters[f"rollout/wasted_tokens/{reason}"] for reason in WASTE_REASONS},
        "capacity_tokens_per_s": {"generation": _round(generation), "training": _round(training)},
        "stale_drops_by_length_quartile": stale_drops_by_quartile(drawn_lengths, outcomes),
    }


def stale_drops_by_quartile(drawn_lengths: Mapping[int, Sequence[int]], outcomes: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Per quartile of prompt length (a prompt's mean drawn length), the share of its ended takes dropped as stale."""
    lengths = {pid: statistics.fmean(ls) for pid, ls in drawn_lengths.items() if ls}
    ended = [o for o in outcomes if o["prompt_id"] in lengths]
    if not ended:
        return [None] * 4
    ranked = sorted(lengths, key=lambda pid: (lengths[pid], pid))
    quartile = {pid: min(3, 4 * i // len(ranked)) for i, pid in enumerate(ranked)}
    totals, stale = [0] * 4, [0] * 4
    for o in ended:
        q = quartile[o["prompt_id"]]
        totals[q] += 1
        stale[q] += o["outcome"] == "dropped" and o.get("reason") == "stale"
    return [_round(s / t) if t else None for s, t in zip(stale, totals)]


def _round(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 6)
