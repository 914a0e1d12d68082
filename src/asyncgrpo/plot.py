"""`asyncgrpo plot RUN_DIR`: PNGs of a run (a training run's directory, or `simulate --output-dir`'s).

Reads `metrics.jsonl` and `timeline.jsonl` and writes, into `RUN_DIR/plots/` (or `--out`):

- rewards.png: the training reward per step, with the evaluations (reward and pass rate) when there are any;
- loss_kl.png: loss and KL per step (a simulation has neither: the panels say so), and under
  `algorithm: distill` distill/kl_mean, the distillation's key metric;
- staleness.png: for each step, how many trained groups had each staleness (from the timeline),
  with the mean and max from the metrics;
- counters.png: failed rollouts, stale groups, dropped groups, retries and requeues so far, per step;
- timeline.png and timeline_start.png (the first steps, zoomed in): the pipeline. Generation
  slots are lanes, each rollout a bar coloured by what became of its group (trained,
  stale-cancelled, failed, dropped, unfinished at exit); the trainer's lane shows each step's
  wait, training and weight sync, and evaluations.

matplotlib is an optional dependency (`pip install 'asyncgrpo[plot]'`); without it, or without the
files, the command fails with one paragraph saying what to do.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.rundir import METRICS_FILE, PLOTS_DIR, TIMELINE_FILE
from asyncgrpo.telemetry.metrics import read_jsonl

COLOURS = {
    "trained": "#2e9e4f",
    "stale": "#f0a020",
    "failed": "#d62728",
    "dropped": "#7f7f7f",
    "unfinished": "#c7c7c7",
    "wait": "#dddddd",
    "train": "#1f5fbf",
    "sync": "#9467bd",
    "eval": "#17becf",
}
ZOOM_STEPS = 8


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the run's PNGs; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise AsyncGRPOError(
            f"asyncgrpo plot needs matplotlib, which this Python cannot import ({exc}). "
            f"Fix: pip install matplotlib (or pip install 'asyncgrpo[plot]')."
        ) from None
    metrics_path, timeline_path = run_dir / METRICS_FILE, run_dir / TIMELINE_FILE
    if not metrics_path.is_file():
        raise AsyncGRPOError(
            f"{run_dir} has no {METRICS_FILE}: it is not a run directory, or its run trained no step yet. "
            f"Fix: pass the directory a `train` run wrote (runs/<run.name>), or one given to `simulate --output-dir`."
        )
    metrics = read_jsonl(metrics_path)
    if not metrics:
        raise AsyncGRPOError(
            f"{metrics_path} holds no step record (it is empty, or its one line was cut short), so there is nothing to draw. "
            f"Fix: plot it once its run has trained a step, or restore the file from a copy (a training run's checkpoints "
            f"keep one in records/)."
        )
    timeline = read_jsonl(timeline_path) if timeline_path.is_file() else []
    out = out_dir if out_dir is not None else run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update({"figure.dpi": 100, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    written = []
    for name, draw in (("rewards", _rewards), ("loss_kl", _loss_kl), ("staleness", _staleness), ("counters", _counters)):
        fig = draw(plt, metrics, timeline)
        written.append(_save(plt, fig, out / f"{name}.png"))
    if timeline:
        pipeline = Pipeline.of(timeline)
        written.append(_save(plt, pipeline.draw(plt, None, f"{run_dir.name}: the pipeline"), out / "timeline.png"))
        steps = [line for line in timeline if line["e"] == "step"]
        if len(steps) > ZOOM_STEPS:
            window = (0.0, steps[ZOOM_STEPS - 1]["sync"][1])
            title = f"{run_dir.name}: the first {ZOOM_STEPS} steps"
            written.append(_save(plt, pipeline.draw(plt, window, title), out / "timeline_start.png"))
    return written


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _rewards(plt: Any, metrics: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4))
    steps, reward = _series(metrics, "reward/mean")
    ax.plot(steps, reward, color="#1f5fbf", alpha=0.35, lw=1, label="reward/mean (train batch)")
    if len(reward) >= 5:
        k = max(2, len(reward) // 20)
        smooth = [sum(reward[max(0, i - k + 1):i + 1]) / len(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
        ax.plot(steps, smooth, color="#1f5fbf", lw=2, label=f"reward/mean, mean of {k} steps")
    evaluated = _evaluations(metrics, timeline)
    for key, style in (("eval/pass_rate", {"marker": "o", "ls": "-", "color": "#2e9e4f", "ms": 7}),
                       ("eval/reward_mean", {"marker": "s", "ls": "--", "color": "#d62728", "ms": 4})):
        points = [(step, line[key]) for step, line in evaluated if line.get(key) is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label=key, **style)
    ax.set(xlabel="step", ylabel="reward", title="Reward (train) and evaluation")
    ax.legend(loc="best")
    return fig


def _evaluations(metrics: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(steps completed, the metrics line that carries that evaluation) of each evaluation.

    An evaluation after n steps is in the line of step n - 1 (the baseline, n = 0, in the first); an
    eval value holds until the next evaluation, so without a timeline each change of value stands for one."""
    by_step = {m["step"]: m for m in metrics}
    done = [line["step"] for line in timeline if line["e"] == "eval"]
    if done:
        return [(n, by_step[max(n - 1, 0)]) for n in done if max(n - 1, 0) in by_step]
    key = "eval/reward_mean"
    return [(m["step"] + 1, m) for i, m in enumerate(metrics) if m.get(key) is not None and (i == 0 or metrics[i - 1].get(key) != m[key])]


def _loss_kl(plt: Any, metrics: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> Any:
    keys = ["loss", "kl", *(["distill/kl_mean"] if metrics and "distill/kl_mean" in metrics[0] else [])]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    for ax, key in zip(axes, keys):
        steps, values = _series(metrics, key)
        if values:
            ax.plot(steps, values, color="#1f5fbf", lw=1.2)
        else:
            ax.text(0.5, 0.5, f"no {key} values\n(a simulation trains nothing)", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="step", title=key)
    return fig


def _staleness(plt: Any, metrics: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    versions: dict[int, int] = {}
    for line in timeline:
        if line["e"] == "rollout" and line["outcome"] == "finished" and line["version"] is not None:
            versions[line["take"]] = min(versions.get(line["take"], line["version"]), line["version"])
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for line in timeline:
        if line["e"] == "buffered" and line["outcome"] == "trained" and line["take"] in versions:
            counts[line["step"]][line["step"] - versions[line["take"]]] += 1
    if counts:
        steps = sorted(counts)
        levels = sorted({s for c in counts.values() for s in c})
        bottom = [0] * len(steps)
        cmap = plt.get_cmap("plasma", len(levels) + 1)
        for i, level in enumerate(levels):
            heights = [counts[s][level] for s in steps]
            ax.bar(steps, heights, bottom=bottom, width=1.0, color=cmap(i), label=f"staleness {level} ({sum(heights)})")
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(ylabel="groups trained")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    else:
        for key in ("staleness/mean", "staleness/max"):
            ax.plot(*_series(metrics, key), label=key)
        ax.legend()
    ax.set(xlabel="step", title="Staleness of the trained groups, per step")
    return fig


COUNTERS = (("rollout/failed_total", "rollout/stale_groups_total", "rollout/dropped_groups_total", "rollout/requeued_total"),
            ("rollout/retries_total",))


def _counters(plt: Any, metrics: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), gridspec_kw={"width_ratios": [3, 2]})
    titles = ("Failed rollouts, stale, dropped and requeued groups", "Retried attempts")
    for ax, keys, title in zip(axes, COUNTERS, titles):
        for key in keys:
            steps, values = _series(metrics, key)
            if values:
                ax.plot(steps, values, lw=1.5, label=f"{key.removeprefix('rollout/')} ({values[-1]:g})")
        ax.set(xlabel="step", ylabel="so far", title=title)
        ax.legend(loc="upper left", fontsize=8)
    return fig


class Pipeline:
    """The timeline's rollouts packed into lanes (a lane is a generation slot), and the trainer's spans."""

    def __init__(self, bars: list[tuple[int, float, float, str]], trainer: list[tuple[str, float, float]], lanes: int, end: float,
                 max_inflight: int) -> None:
        self.bars, self.trainer, self.lanes, self.end, self.max_inflight = bars, trainer, lanes, end, max_inflight

    @classmethod
    def of(cls, timeline: list[dict[str, Any]]) -> Pipeline:
        fate = _take_fates(timeline)
        rollouts = sorted((line for line in timeline if line["e"] == "rollout"), key=lambda line: (line["start"], line["end"]))
        free: list[int] = []  # lanes free now, lowest first
        busy: list[tuple[float, int]] = []  # (end, lane)
        bars = []
        for line in rollouts:
            while busy and busy[0][0] <= line["start"]:
                heapq.heappush(free, heapq.heappop(busy)[1])
            lane = heapq.heappop(free) if free else len(busy)
            heapq.heappush(busy, (line["end"], lane))
            outcome = "failed" if line["outcome"] == "failed" else fate.get(line["take"], "unfinished")
            bars.append((lane, line["start"], line["end"], outcome))
        trainer = []
        for line in timeline:
            if line["e"] == "step":
                trainer += [(part, *line[part]) for part in ("wait", "train", "sync")]
            elif line["e"] == "eval":
                trainer.append(("eval", *line["span"]))
        lanes = 1 + max((b[0] for b in bars), default=0)
        end = max([b[2] for b in bars] + [t[2] for t in trainer] + [0.0])
        start = next((line for line in timeline if line["e"] == "start"), {})
        return cls(bars, trainer, lanes, end, start.get("max_inflight", 0))

    def draw(self, plt: Any, window: tuple[float, float] | None, title: str) -> Any:
        lo, hi = window if window is not None else (0.0, self.end)
        height = min(9.0, 2.0 + 0.06 * self.lanes)
        fig, (gen, train) = plt.subplots(2, 1, figsize=(12, height), sharex=True,
                                        gridspec_kw={"height_ratios": [max(3, self.lanes // 8), 1]})
        by_outcome: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
        for lane, start, end, outcome in self.bars:
            if end >= lo and start <= hi:
                by_outcome[outcome].append((lane, start, end))
        for outcome in ("trained", "stale", "failed", "dropped", "unfinished"):
            bars = by_outcome.get(outcome, [])
            lanes: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for lane, start, end in bars:
                lanes[lane].append((start, max(end - start, 1e-9)))
            for lane, spans in lanes.items():
                gen.broken_barh(spans, (lane, 0.8), facecolors=COLOURS[outcome], linewidth=0)
            gen.bar(0, 0, color=COLOURS[outcome], label=f"{outcome} ({len(bars)})")
        if self.max_inflight:
            gen.axhline(self.max_inflight, color="black", lw=0.8, ls="--")
            gen.text(lo, self.max_inflight, " generation.max_inflight", va="bottom", fontsize=8)
        gen.set(ylim=(0, max(self.lanes, self.max_inflight) + 1), title=title,
                ylabel="rollouts in progress\n(one lane each; a rollout waiting\nto retry holds no request slot)")
        gen.grid(False)
        gen.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="rollouts, by what\nbecame of the group")
        for part, row in (("wait", 0), ("train", 0), ("sync", 1), ("eval", 2)):
            spans = [(s, max(e - s, 1e-9)) for p, s, e in self.trainer if p == part and e >= lo and s <= hi]
            if spans:
                train.broken_barh(spans, (row, 0.8), facecolors=COLOURS[part], linewidth=0)
            train.bar(0, 0, color=COLOURS[part], label={"wait": "waiting for a batch", "train": "training a step",
                                                        "sync": "weight sync", "eval": "evaluation"}[part])
        train.set(ylim=(0, 3), yticks=[0.4, 1.4, 2.4], yticklabels=["steps", "sync", "eval"], xlim=(lo, hi), xlabel="seconds since start")
        train.grid(False)
        train.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="trainer")
        return fig


def _take_fates(timeline: list[dict[str, Any]]) -> dict[int, str]:
    """What became of each take: trained, stale (requeued or dropped as stale), dropped (another reason)."""
    fate: dict[int, str] = {}
    for line in timeline:
        if line["e"] == "take" and line["ending"] != "buffered":
            fate[line["take"]] = "stale" if line["ending"] in ("requeued", "stale") else "dropped"
        elif line["e"] == "buffered":
            fate[line["take"]] = "trained" if line["outcome"] == "trained" else "stale"
    return fate
