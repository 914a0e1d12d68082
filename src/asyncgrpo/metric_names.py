"""Metric names (DESIGN.md §5), grouped by who produces them. Part of the interface: rename nothing.

Every name a `metrics.jsonl` line carries is defined here (plus `reward/<function>` and
`eval/reward/<function>` per reward function); producers fill dicts keyed by these names and
telemetry/metrics.py checks the set.
"""

from __future__ import annotations

from asyncgrpo.types import DROP_REASONS

WASTE_REASONS = ("stale", "failed", "filtered")  # rollout/token_books.py: the buckets of wasted tokens

# Agent sessions (agents/): why a request was refused, and how an episode failed.
AGENT_REFUSALS = ("malformed", "unsupported", "turn_limit", "context_limit", "after_close")
# The command agents' own failures (agents/command.py) follow the first four.
AGENT_FAILURES = ("raised", "no_model_call", "bad_return", "timeout", "not_found", "exit", "no_reward", "bad_output", "bad_row")
AGENT_COUNTERS = (
    *(f"agent/refused/{reason}" for reason in AGENT_REFUSALS),
    *(f"agent/failed/{kind}" for kind in AGENT_FAILURES),
    "agent/unparsed_tool_calls_total",
    "agent/split_samples_total",  # a request that rewrote its history started a new sample (env.agent_history: split)
    "agent/killed_total",  # a command agent's process group SIGKILLed after env.cancel_grace_s
    "agent/release_timeout_total",  # the gateway's server stop outlived its deadline (agents/gateway.py)
)

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
# Off-policy diagnostics (training/offpolicy.py): per staleness value s in 0..rollout.max_staleness, under
# `offpolicy/s{s}/`, and the engine mismatch measured at staleness 0. Returned by the torch trainer every step.
OFFPOLICY_BUCKET_KEYS = ("tokens", "clip_frac", "is_ratio/mean", "is_ratio/p1", "is_ratio/p99", "masked_frac", "ess")
ENGINE_MISMATCH_KEYS = ("engine_mismatch/tokens", "engine_mismatch/logp_abs_mean", "engine_mismatch/logp_abs_max",
                        "engine_mismatch/kl")


def offpolicy_keys(max_staleness: int) -> tuple[str, ...]:
    """The off-policy diagnostics' names of a run whose groups are at most `max_staleness` steps old."""
    return (*(f"offpolicy/s{s}/{key}" for s in range(max_staleness + 1) for key in OFFPOLICY_BUCKET_KEYS),
            *ENGINE_MISMATCH_KEYS)


# Reported by the trainers under `algorithm: distill` only (distill/judge.py).
DISTILL_KEYS = ("distill/kl_mean",)
# The collector's state at the end of a step (`Collector.metric_values()`).
COLLECTOR_GAUGES = ("rollout/inflight", "buffer/size", "rollout/trained_version_span")
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
    *AGENT_COUNTERS,  # agent sessions (agents/episode.py): refused requests by reason, failed endings by kind, unparsed tool calls
    # Where tokens and generator time end up (rollout/token_books.py).
    "rollout/trained_tokens_total",
    "rollout/trained_completions_total",
    *(f"rollout/wasted_tokens/{reason}" for reason in WASTE_REASONS),
    "rollout/generation_ms_total",
    "rollout/trained_generation_ms_total",
    # rollout.on_stale: resume (rollout/resume.py): rollouts interrupted and continued, tokens masked as older than the bound.
    "rollout/resumed_rollouts_total",
    "rollout/masked_stale_tokens_total",
)
# The generation backend's own running totals (`stats()` of the HTTP and Ray generators and their weight publishers),
# by the backend's counter name; null in every line of a run whose backend does not keep that counter (the local engine
# keeps none). Server failures, recoveries and weight-sync fallbacks thus reach metrics.jsonl and the trackers.
GENERATOR_COUNTERS = {
    name: f"generation/{name}" + ("" if name.endswith("_fraction") else "_total")
    for name in (
        # the HTTP server pool (generation/http_servers.py, http.py, http_probes.py)
        "weight_sync_failures", "unhealthy_marks", "recoveries", "attempt_timeouts", "hung_suspensions", "hung_returns",
        "session_moves",
        # the Ray actor pool (generation/ray_pool.py)
        "actor_failures", "refusals",
        # the weight publishers: delta, LoRA adapters, collective (generation/*_publisher.py)
        "weight_sync_deltas", "weight_sync_full_loads", "weight_sync_delta_fallbacks", "weight_sync_bytes_staged",
        "weight_sync_changed_fraction", "weight_sync_adapters", "weight_sync_lora_fallbacks", "weight_sync_collective",
        "weight_sync_collective_failures", "weight_sync_disk_fallbacks", "weight_sync_bytes_broadcast",
        "weight_sync_collective_abandoned",
    )
}
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

# TRL's GRPOTrainer (trl 1.16) name of each key with a counterpart: with `logging.metric_names: trl` the trackers
# get these beside ours (metrics.jsonl keeps ours only). `loss`, `grad_norm`, `kl` and `entropy` are the same in both.
TRL_NAMES = {
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "completion/len_mean": "completions/mean_length",
    "completion/len_max": "completions/max_length",
    "completion/truncated_frac": "completions/clipped_ratio",
    "clip_frac": "clip_ratio/region_mean",  # the fraction of tokens whose ratio was clipped, either side
    "lr": "learning_rate",
    "eval/reward_mean": "eval_reward",
}


def trl_name(key: str) -> str | None:
    """TRL's name of metric `key`, None where TRL logs none (or the same name): `reward/<function>` is
    `rewards/<function>/mean`, `eval/reward/<function>` is `eval_rewards/<function>/mean`."""
    if key in TRL_NAMES:
        return TRL_NAMES[key]
    for ours, theirs in (("eval/reward/", "eval_rewards/"), ("reward/", "rewards/")):
        if key.startswith(ours):
            return f"{theirs}{key.removeprefix(ours)}/mean"
    return None
