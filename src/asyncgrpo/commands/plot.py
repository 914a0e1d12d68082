"""`asyncgrpo plot RUN_DIR`: PNGs of a run (a training run's directory, or `simulate --output-dir`'s).

Reads `metrics.jsonl` and `timeline.jsonl` and writes, into `RUN_DIR/plots/` (or `--out`):

- rewards.png: the training reward per step, with the evaluations (reward and pass rate) when there are any;
- loss_kl.png: loss, KL (only when the loss has a KL term) and, under `algorithm: distill`,
  distill/kl_mean, the distillation's key metric;
- staleness.png: for each step, how many trained groups had each staleness (from the timeline),
  with the mean and max from the metrics;
- counters.png: failed rollouts, stale, dropped and requeued groups, and retries so far, per step;
- offpolicy.png: "is it staleness or the engine?": the engine mismatch at staleness 0 (left), and per
  staleness value the importance ratio's mean and p1-p99 band (middle) and the clip fraction and ESS
  (right); docs/troubleshooting.md says how to read it;
- env.png (runs with an environment): turns per episode, the environment's reward, its errors and
  abandoned episodes, and re-tokenization drift;
- distill.png (`algorithm: distill`): every distill/* metric, and the student's completion length;
- timeline.png and timeline_start.png (the first steps, zoomed in): the pipeline (plot_timeline.py).

Invariant: a series that carries no information (no value, or 0 at every step) is left out, a panel
without any series is left out, and a figure without any panel is not written (a stale copy of it
in the output directory is removed); each is named, with why, in `Plots.left_out`, which the command
prints. matplotlib is a dependency of asyncgrpo; without it, or without the files, the command fails
with one paragraph saying what to do.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.commands.plot_timeline import Pipeline
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.rundir import METRICS_FILE, PLOTS_DIR, TIMELINE_FILE
from asyncgrpo.telemetry.metrics import read_jsonl

ZOOM_STEPS = 8
Metrics = list[dict[str, Any]]


@dataclass
class Plots:
    """What `plot_run` wrote, and what it left out and why (one line each: "FILE: ...")."""

    written: list[Path] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def plot_run(run_dir: Path, out_dir: Path | None = None) -> Plots:
    """Write the run's PNGs; returns their paths and what was left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise AsyncGRPOError(
            f"asyncgrpo plot needs matplotlib, a dependency of asyncgrpo that this Python cannot import ({exc}): "
            f"asyncgrpo was installed without its dependencies (pip --no-deps), or matplotlib was removed since. "
            f"Fix: pip install matplotlib."
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
    plots = Plots()
    figures: dict[str, Callable[[Any, Metrics, Metrics, list[str]], Any]] = {
        "rewards": _rewards, "loss_kl": _loss_kl, "staleness": _staleness, "counters": _counters, "offpolicy": _offpolicy,
        "env": _env, "distill": _distill}
    for name, draw in figures.items():
        notes: list[str] = []
        fig = draw(plt, metrics, timeline, notes)
        plots.left_out += [f"{name}.png: {note}" for note in notes]
        if fig is None:
            stale = out / f"{name}.png"
            if out_dir is None:  # the run's own plots/: a copy from an earlier `plot` would read as this run's
                stale.unlink(missing_ok=True)
            elif stale.exists():  # a folder the user chose: asyncgrpo may not have written it, so it stays
                plots.left_out.append(f"{name}.png: an older {stale} was kept (not written by this plot; --out is yours)")
        else:
            plots.written.append(_save(plt, fig, out / f"{name}.png"))
    if timeline:
        pipeline = Pipeline.of(timeline)
        plots.written.append(_save(plt, pipeline.draw(plt, None, f"{run_dir.name}: the pipeline"), out / "timeline.png"))
        steps = [line for line in timeline if line["e"] == "step"]
        if len(steps) > ZOOM_STEPS:
            window = (0.0, steps[ZOOM_STEPS - 1]["sync"][1])
            title = f"{run_dir.name}: the first {ZOOM_STEPS} steps"
            plots.written.append(_save(plt, pipeline.draw(plt, window, title), out / "timeline_start.png"))
    return plots


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    points = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _informative(metrics: Metrics, keys: Sequence[str], notes: list[str], why: str = "") -> list[str]:
    """The keys whose series has a value other than 0. A note names the others that the run's metrics carry: those
    without any value, and those 0 at every step (`why`: what that means)."""
    kept = [key for key in keys if any(_series(metrics, key)[1])]
    carried = [key for key in keys if key not in kept and any(key in m for m in metrics)]
    for group, reason in (([k for k in carried if not _series(metrics, k)[1]], "no value at any step"),
                          ([k for k in carried if _series(metrics, k)[1]], f"0 at every step{why}")):
        if group:
            notes.append(f"left out {', '.join(group)} ({reason})")
    return kept


def _line_panels(plt: Any, metrics: Metrics, keys: Sequence[str], title: str, notes: list[str]) -> Any:
    """One panel per key, its series per step; the notes (what was left out) under them."""
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys) + 1, 3.5), squeeze=False)
    fig.suptitle(title, y=1.02)
    for ax, key in zip(axes[0], keys):
        ax.plot(*_series(metrics, key), color="#1f5fbf", lw=1.2, marker="o" if len(metrics) <= 30 else None, ms=3)
        ax.set(xlabel="step", title=key)
    _footnote(fig, notes)
    return fig


def _footnote(fig: Any, notes: list[str]) -> None:
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), ha="left", va="top", fontsize=8, color="#555555")


def _rewards(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
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


def _loss_kl(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
    """Loss; KL only when the loss has a KL term (else it is 0 at every step); distill/kl_mean under distill."""
    keys = [*_informative(metrics, ["loss"], notes),
            *_informative(metrics, ["kl"], notes, ": the loss has no KL term, train.loss.kl_coef: 0"),
            *_informative(metrics, ["distill/kl_mean"], notes)]
    if not keys:
        notes.append("not written: no panel left")
        return None
    return _line_panels(plt, metrics, keys, "Loss and KL" if len(keys) > 1 else "Loss", notes)


def _offpolicy(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
    """Engine mismatch (staleness 0) apart from staleness drift (each staleness value), per step."""
    keys = [k for k in metrics[0] if k.startswith(("offpolicy/", "engine_mismatch/"))]
    if not any(m.get(k) is not None for m in metrics for k in keys):
        notes.append("not written: no off-policy value (only the torch trainer measures them; a simulation trains nothing)")
        return None
    fig, (engine, ratio, clip) = plt.subplots(1, 3, figsize=(14, 3.8))
    fig.suptitle("Is it staleness or the engine?  Left: the engine alone (staleness-0 tokens; steps without any show no point).  "
                 "Middle, right: each staleness s; rows s >= 1 that drift from s = 0 are staleness.", fontsize=9, y=1.03)
    for key, style in (("engine_mismatch/logp_abs_mean", "-"), ("engine_mismatch/logp_abs_max", ":"), ("engine_mismatch/kl", "--")):
        steps, values = _series(metrics, key)
        if values:
            engine.plot(steps, values, ls=style, lw=1.2, marker="o", ms=3, label=key.removeprefix("engine_mismatch/"))
    engine.set(xlabel="step", title="engine mismatch at staleness 0 (nats)")
    stalenesses = sorted({int(k.split("/")[1][1:]) for m in metrics[:1] for k in m if k.startswith("offpolicy/s") and k.endswith("/tokens")})
    for s in stalenesses:
        colour = f"C{s % 10}"
        steps, mean = _series(metrics, f"offpolicy/s{s}/is_ratio/mean")
        if not mean:
            continue
        band = [(m["step"], m[f"offpolicy/s{s}/is_ratio/p1"], m[f"offpolicy/s{s}/is_ratio/p99"]) for m in metrics
                if m.get(f"offpolicy/s{s}/is_ratio/p1") is not None]
        ratio.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=colour, alpha=0.2)
        ratio.plot(steps, mean, color=colour, lw=1.2, marker="o", ms=2, label=f"s={s} mean (band p1-p99)")
        for key, style in (("clip_frac", "-"), ("ess", "--")):
            steps, values = _series(metrics, f"offpolicy/s{s}/{key}")
            clip.plot(steps, values, color=colour, ls=style, lw=1.2, marker="o", ms=2, label=f"s={s} {key}")
    ratio.axhline(1.0, color="#888888", lw=0.8)
    ratio.set(xlabel="step", title="importance ratio pi_theta / pi_gen by staleness")
    clip.set(xlabel="step", title="clip fraction (solid) and ESS (dashed) by staleness")
    for ax in (engine, ratio, clip):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7)
    return fig


def _staleness(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
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


def _counters(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
    """The failure counters so far; one that stayed 0 is left out, and so is a panel with none left."""
    left_out: list[str] = []
    panels = [(kept, title) for keys, title in zip(COUNTERS, ("Failed rollouts, stale, dropped and requeued groups", "Retried attempts"))
              if (kept := _informative(metrics, keys, left_out))]
    if not panels:
        notes.append("not written: no rollout failed or was retried, and no group went stale, was dropped or requeued")
        return None
    notes += left_out
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.5), squeeze=False)
    for ax, (keys, title) in zip(axes[0], panels):
        for key in keys:
            steps, values = _series(metrics, key)
            ax.plot(steps, values, lw=1.5, label=f"{key.removeprefix('rollout/')} ({values[-1]:g})")
        ax.set(xlabel="step", ylabel="so far", title=title)
        ax.legend(loc="upper left", fontsize=8)
    _footnote(fig, notes)
    return fig


def _env(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
    """An environment run's own metrics (env/turns_mean has a value only when episodes are played)."""
    if not any(_series(metrics, "env/turns_mean")[1]):
        return None
    rewards = sorted({k for m in metrics[:1] for k in m if k.startswith("reward/") and k not in ("reward/mean", "reward/std")})
    keys = ["env/turns_mean", *_informative(metrics, rewards, notes),
            *_informative(metrics, ["env/errors_total", "env/abandoned_total", "env/retokenization_drift_total"], notes)]
    return _line_panels(plt, metrics, keys, "The environment: turns per episode, its reward terms, errors and drift", notes)


def _distill(plt: Any, metrics: Metrics, timeline: Metrics, notes: list[str]) -> Any:
    """A distillation run's own metrics: every distill/* key, and the length of the student's samples."""
    keys = sorted({k for m in metrics[:1] for k in m if k.startswith("distill/")})
    if not keys:
        return None
    keys = _informative(metrics, keys, notes) + _informative(metrics, ["completion/len_mean"], notes)
    if not keys:
        notes.append("not written: no panel left")
        return None
    return _line_panels(plt, metrics, keys, "Distillation: the student's reverse KL to the teacher, and its samples' length", notes)
