"""The logging: section: progress, where metrics go and under which names, and how much is written in full."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.section import Section

Sink = Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]


class LoggingConfig(Section):
    """Progress, metric sinks and their names, and what is written in full (samples, timeline, failures)."""

    progress: bool = Field(True, description="A progress bar on stderr; false: a log line every tenth of the run instead (CI logs, files).")
    sinks: list[Sink] = Field(
        default_factory=lambda: list[Sink](["jsonl"]),
        description="Where step metrics go, any combination of jsonl, tensorboard, wandb, mlflow, trackio; metrics.jsonl is "
        "always written. Each tracker needs its package (pip install 'asyncgrpo[sinks]'); `check` says which is missing.",
    )
    project: str = Field(
        "asyncgrpo", min_length=1, description="Project (W&B, trackio) or experiment (MLflow) name the run is logged under, as run.name.",
    )
    metric_names: Literal["asyncgrpo", "trl"] = Field(
        "asyncgrpo",
        description="trl: the trackers of logging.sinks also get TRL GRPOTrainer's name of each metric that has one "
        "(reward, reward_std, completions/mean_length, rewards/<function>/mean, learning_rate, ...), so TRL dashboards carry "
        "over; metrics.jsonl keeps asyncgrpo's names only.",
    )
    timeline_max_rollouts: int = Field(
        50_000, ge=0,
        description="Rollout spans written in full to timeline.jsonl; later ones are counted per step instead (takes, steps and "
        "evaluations are always written).",
    )
    samples_per_step: int = Field(2, ge=0, description="Completions per step written to samples.jsonl.")
    blocked_loop_warn_s: float = Field(
        10.0, gt=0,
        description="Warn (with where its thread is) when the event loop has not turned for this long: user code blocking it stops rollouts, "
        "timeouts and stop requests.",
    )
    failure_summary_s: float = Field(
        30.0, gt=0,
        description="Tolerated failures (retries, failed rollouts, reward errors dropped): the first of each error class "
        "and source is logged with its message, then a summary of the counts at most this often (seconds of loop time).",
    )

