"""Metric names (DESIGN.md §5), grouped by who produces them. Part of the interface: rename nothing.

Every name a `metrics.jsonl` line carries is defined here (plus `reward/<function>` and
`eval/reward/<function>` per reward function); producers fill dicts keyed by these names and
telemetry/metrics.py checks the set.
"""

from __future__ import annotations

from asyncgrpo.types import DROP_REASONS

WASTE_REASONS = ("stale", "failed", "filtered")  # rollout/token_books.py: the buckets of wasted tokens

STEP_KEYS = ("step", "version")

TRAIN_KEYS = (
    "loss",
    "kl",
    "clip_frac",
    "is_ratio/mean",
    "is_ratio/max",
    "entropy",
    "grad_norm",
    "lr",
    "advantage/mean",
    "advantage/std",
    "completion/len_mean",
    "completion/len_max",
    "completion/truncated_frac",
)
# Reported by the trainers under `algorithm: distill` only (distill/judge.py).
DISTILL_KEYS = ("distill/kl_mean",)
# The collector's state at the end of a step (`Collector.metric_values()`).
COLLECTOR_GAUGES = ("rollout/inflight", "buffer/size")
# The collector's running totals since the start of the run (kept across a resume).
COUNTER_NAMES: tuple[str, ...] = (
    "rollout/failed_total",
    "rollout/dropped_groups_total",
    *(f"rollout/dropped/{reason}" for reason in DROP_REASONS),
    "rollout/stale_groups_total",
    "rollout/stale_samples_total",
    "rollout/stale_completions_total",  # the finished ones among them (under distill an unfinished sample counts as one)
    "rollout/retries_total",
    "rollout/requeued_total",
    "rollout/wasted_tokens_total",
    "rollout/generated_tokens_total",
    "env/errors_total",
    "env/abandoned_total",
    "env/retokenization_drift_total",
    # Where tokens and generator time end up (rollout/token_books.py).
    "rollout/trained_tokens_total",
    "rollout/trained_completions_total",
    *(f"rollout/wasted_tokens/{reason}" for reason in WASTE_REASONS),
    "rollout/generation_ms_total",
    "rollout/trained_generation_ms_total",
)
EVAL_KEYS = ("eval/reward_mean", "eval/pass_rate", "eval/failed_requests")
PIPELINE_KEYS = (
    *COLLECTOR_GAUGES,
    "staleness/mean",
    "staleness/max",
    "time/trainer_wait_s",
    "time/step_s",
    "time/weight_sync_s",
    "time/elapsed_s",
    "throughput/gen_tokens_per_s",
    "reward/mean",
    "reward/std",
    "rollout/stale_len_mean",
    "env/turns_mean",
    "rollout/trained_len_mean",
    "rollout/goodput",
)
