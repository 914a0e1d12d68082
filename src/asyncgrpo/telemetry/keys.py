"""Metric names (DESIGN.md §5), grouped by who produces them. Part of the interface: rename nothing."""

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
EVAL_KEYS = ("eval/reward_mean", "eval/pass_rate", "eval/failed_requests")
PIPELINE_KEYS = (
    "rollout/inflight",
    "buffer/size",
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
)
