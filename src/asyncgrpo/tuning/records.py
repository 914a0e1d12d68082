"""Read what calibration needs from a run directory: its config, timeline and metrics, as plain records.

Job: turn RUN_DIR/config.yaml, timeline.jsonl and metrics.jsonl into a `RunRecords`, or raise
`CalibrationError` naming what is missing and how to produce it (a foreign directory, no timeline,
no rollout spans, too few steps); `check_poolable` refuses a run that cannot join another's fits (another model
or backend). Nothing here fits or simulates.

Invariants: every rollout span and episode turn carries its prompt (from its take's line); steps are in step order; a run
that plays episodes (env:) has turn and environment-call lines (telemetry/timeline.py), else it is refused;
`trained_tokens[i]` is the tokens trained by `steps[i]` (from metrics.jsonl's running total).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config import Config
from asyncgrpo.config.loading import validate_config
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.rundir import CONFIG_FILE, MARKER, METRICS_FILE, TIMELINE_FILE

MIN_STEPS = 5  # fewer steps say too little about the trainer and the pipeline's steady state


class CalibrationError(AsyncGRPOError):
    """A run directory lacks what calibration needs; the message names it and how to produce it."""


@dataclass
class RunRecords:
    """One run's records, as calibration and validation read them."""

    run_dir: Path
    config: Config
    rollouts: list[dict[str, Any]]  # timeline "rollout" lines, each with "prompt" added
    takes: list[dict[str, Any]]
    buffered: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]  # inside the training loop: a process's baseline evaluation, before its first step, left out
    trained_tokens: list[int]  # per step
    last_metrics: dict[str, Any]
    unrecorded: dict[str, int] = field(default_factory=dict)  # rollout spans the timeline only counted
    turns: list[dict[str, Any]] = field(default_factory=list)  # an episode's "turn" lines, each with "prompt" added
    completion_tokens: list[int] = field(default_factory=list)  # per step, every completion token trained (an episode's env ones too)
    env_calls: list[dict[str, Any]] = field(default_factory=list)  # an episode's "env" lines (reset and step)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The generation requests' spans ({start, end, tokens, outcome, prompt}): an episode's turns, else the rollouts."""
        return [{**t, "outcome": "finished"} for t in self.turns] if self.config.env is not None else self.rollouts

    @property
    def trainer_tokens(self) -> list[int]:
        """Per step, the tokens the trainer's time goes with (the simulator's too): with episodes every completion token,
        the environment's included; else the trained tokens (the same)."""
        return self.completion_tokens if self.config.env is not None else self.trained_tokens


def load_run(run_dir: Path) -> RunRecords:
    """The records of the run in `run_dir`, or a CalibrationError saying what is missing and how to produce it."""
    if not run_dir.is_dir():
        raise CalibrationError(f"{run_dir} is not a directory. Fix: give the run directory of a finished `asyncgrpo train` run (runs/<run.name>).")
    config_path = run_dir / CONFIG_FILE
    if not (run_dir / MARKER).exists() or not config_path.exists():
        raise CalibrationError(
            f"{run_dir} is not an asyncgrpo run directory (it has no {MARKER} marker or no {CONFIG_FILE}); "
            f"`asyncgrpo tune` calibrates from what `asyncgrpo train` writes there. Fix: give a run directory "
            f"(runs/<run.name>, or the run's run.output_dir), or produce one with `asyncgrpo train RECIPE`."
        )
    config = validate_config(yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}, str(config_path))
    timeline = _read_jsonl(run_dir / TIMELINE_FILE, what="the run's timeline (every rollout, step and weight sync)")
    metrics = _read_jsonl(run_dir / METRICS_FILE, what="the run's per-step metrics")
    records = _split_timeline(run_dir, config, timeline, metrics)
    _check_enough(records)
    return records


def _read_jsonl(path: Path, *, what: str) -> list[dict[str, Any]]:
    if not path.exists():
        raise CalibrationError(
            f"{path} is missing: calibration needs {what}. asyncgrpo train writes it in every run directory; a run "
            f"interrupted before its first step, or copied without it, has none. Fix: train again (a short run will do: "
            f"train.max_steps={4 * MIN_STEPS}) and tune that directory."
        )
    lines = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                if text.endswith("\n"):
                    raise CalibrationError(f"{path}, line {number}, is not JSON ({text[:60]!r}). Fix: tune an unedited run directory.") from None
                # a last line cut short by a killed run: the records before it stand
    return lines


def _split_timeline(run_dir: Path, config: Config, timeline: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> RunRecords:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for line in timeline:
        by_kind.setdefault(str(line.get("e")), []).append(line)
    prompt_of = {t["take"]: t["prompt"] for t in by_kind.get("take", [])}
    rollouts = [{**r, "prompt": prompt_of[r["take"]]} for r in by_kind.get("rollout", []) if r["take"] in prompt_of]
    unrecorded: dict[str, int] = {}
    for line in (*by_kind.get("step", []), *by_kind.get("end", [])):
        for key, value in line.get("unrecorded", {}).items():
            unrecorded[key] = unrecorded.get(key, 0) + int(value)
    steps = sorted({s["step"]: s for s in by_kind.get("step", [])}.values(), key=lambda s: s["step"])  # a resume may repeat one
    by_step = {m["step"]: m for m in metrics if "step" in m}
    trained, completion_tokens, previous, completions = [], [], 0, 0
    for s in steps:
        line = by_step.get(s["step"], {})
        total = int(line.get("rollout/trained_tokens_total") or previous)
        trained.append(total - previous)
        previous = total
        count = int(line.get("rollout/trained_completions_total") or completions)  # the batch's mean length x its completions
        completion_tokens.append(round(float(line.get("completion/len_mean") or 0.0) * (count - completions)))
        completions = count
    baselines = {0} | {line["step"] for line in by_kind.get("start", [])}  # each process evaluates once before its loop
    evals = [e for e in by_kind.get("eval", []) if e["step"] not in baselines]
    turns = [{**t, "prompt": prompt_of[t["take"]]} for t in by_kind.get("turn", []) if t["take"] in prompt_of]
    return RunRecords(run_dir, config, rollouts, by_kind.get("take", []), by_kind.get("buffered", []), steps, evals,
                      trained, metrics[-1] if metrics else {}, unrecorded, turns, completion_tokens, by_kind.get("env", []))


def _check_enough(records: RunRecords) -> None:
    where = records.run_dir
    if len(records.steps) < MIN_STEPS:
        raise CalibrationError(
            f"{where / TIMELINE_FILE} records {len(records.steps)} training steps; calibration needs at least {MIN_STEPS} "
            f"to measure the trainer and the pipeline's steady state. Fix: train longer (train.max_steps={4 * MIN_STEPS} or more) and tune that run."
        )
    if not any(r["outcome"] == "finished" for r in records.rollouts):
        raise CalibrationError(
            f"{where / TIMELINE_FILE} has no finished rollout span (logging.timeline_max_rollouts = "
            f"{records.config.logging.timeline_max_rollouts}), so completion lengths and decode times cannot be fitted. "
            f"Fix: train again with logging.timeline_max_rollouts of at least 1000."
        )
    if records.config.env is not None and not (records.turns and any(c["call"] == "step" for c in records.env_calls)):
        raise CalibrationError(
            f"{where / TIMELINE_FILE} records no episode turns and environment steps (\"turn\" and \"env\" lines), so the "
            f"environment's time per call, its turns per episode and each turn's decoding cannot be fitted. The timeline writes them "
            f"for episodes that env.factory plays (an agent: factory, played through the gateway, writes none), and a run recorded "
            f"before they were has none (env.factory = {records.config.env.factory!r}). Fix: train again with this asyncgrpo and an "
            f"env.factory environment, and tune that run."
        )
    if sum(records.trained_tokens) <= 0:
        raise CalibrationError(
            f"{where / METRICS_FILE} counts no trained tokens (rollout/trained_tokens_total), so the trainer's time per token "
            f"cannot be fitted. Fix: tune the directory of a run that trained (asyncgrpo train RECIPE)."
        )


def check_poolable(records: RunRecords, other: RunRecords) -> None:
    """`other` may join `records`' decode and trainer fits: the same model on the same generation backend (else its times
    are another system's). The machine cannot be checked: runs side by side, or one after the other, pool best."""
    ours, theirs = records.config, other.config
    mismatches = [f"{key} is {a!r} there and {b!r} here" for key, a, b in (
        ("model.path", theirs.model.path, ours.model.path),
        ("generation.backend", theirs.generation.backend, ours.generation.backend),
    ) if a != b]
    if mismatches:
        raise CalibrationError(
            f"{other.run_dir} cannot be pooled with {records.run_dir}: {'; '.join(mismatches)}, so its decode and trainer times "
            f"are another system's. Fix: pool runs of the same model and backend (e.g. the same recipe at rollout.max_staleness=0), "
            f"or leave --pool out."
        )
