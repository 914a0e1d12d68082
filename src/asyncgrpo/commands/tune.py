"""`asyncgrpo tune RUN_DIR`: calibrate the simulator from a run, check it replays the run, then advise.

Job: the command's flow and its output. It loads the run (tuning/records.py), fits the simulator and
writes RUN_DIR/tuned.yaml (tuning/calibrate.py), replays the run's own config on virtual time and prints
predicted against measured (tuning/observe.py), and so each run pooled into the decode and trainer fits (--pool),
with its own settings of the swept keys; only when the replay is within tolerance does it sweep
(tuning/sweep.py) and print the frontier and a recommended config as dotted overrides with its reason.
`--json` prints one object instead; `--plot` draws the frontier to RUN_DIR/tune.png.

A run that plays episodes (env:) is calibrated per turn and its environment from its calls (tuning/calibrate.py) and
advised on like any other when its replay holds; when it misses, the message gives the fitted simulate.env to start from.

Exit codes: 0 advice given; 1 the replay missed the tolerance, so no advice (the table says by how much),
or the run directory lacks what calibration needs (the message names it and how to produce it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.commands.sim_metrics import population_length
from asyncgrpo.commands.simulate import Simulation, simulate
from asyncgrpo.config import Config
from asyncgrpo.rundir import TUNE_PLOT_FILE
from asyncgrpo.tuning.calibrate import Calibration, calibrate, recipe_config, with_overrides, write_tuned
from asyncgrpo.tuning.observe import Comparison, Observed, compare, observe, observe_run
from asyncgrpo.tuning.records import RunRecords, check_poolable, load_run
from asyncgrpo.tuning.sweep import KEYS, POLICIES, Point, Recommendation, candidates, frontier, policies_for, recommend, run_sweep

ENV_MISSED = (
    "this run plays episodes (env:): the simulator's environment model fitted to its calls is {fitted} (simulate.env in "
    "tuned.yaml), but its replay misses the run. Fix: start from those values, change the model that is off (tuned.yaml; "
    "`asyncgrpo simulate` checks it), or calibrate from a longer run; tune does not advise from a replay that misses."
)
SWEEP_STEPS = 60  # at most, per swept config: enough for the steady state, ~50 of them in well under a minute


@dataclass
class TuneResult:
    calibration: Calibration
    tuned_path: Path
    comparison: Comparison
    points: list[Point]
    frontier: list[Point]
    recommendation: Recommendation | None

    def to_json(self) -> dict[str, Any]:
        rec = self.recommendation
        return {
            "tuned_recipe": str(self.tuned_path),
            "calibration": self.calibration.to_json(),
            "validation": {"ok": self.comparison.ok, "rows": self.comparison.rows, "reasons": self.comparison.reasons},
            "sweep": [p.to_json() for p in self.points],
            "frontier": [p.to_json() for p in self.frontier],
            "recommendation": None if rec is None else {"overrides": rec.changes, "reason": rec.reason, "predicted": rec.point.to_json()},
        }


def observe_simulation(sim: Simulation) -> Observed:
    """What a simulation did, measured as tuning/observe.py measures a run (its population: every drawn length)."""
    counters = sim.collector.counters
    return observe(
        ((r.wait_s, r.step_s, r.weight_sync_s) for r in sim.records), (s for r in sim.records for s in r.staleness),
        trained_tokens=counters["rollout/trained_tokens_total"], trained_completions=counters["rollout/trained_completions_total"],
        generated_tokens=counters["rollout/generated_tokens_total"], wasted_tokens=counters["rollout/wasted_tokens_total"],
        population_length=population_length(getattr(sim.generator, "drawn_lengths", {})), eval_s=sum(end - start for start, end in sim.evals),
    )


def simulate_one(cfg: Config) -> tuple[Observed, float | None, str | None]:
    """One simulation as the sweep ranks it: what it did, its token efficiency, and why it does not count (None: it does)."""
    quiet = logging.getLogger("asyncgrpo")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the simulator's warnings are about its scripted completions, not the user's run
    try:
        sim = simulate(cfg)
    finally:
        quiet.setLevel(level)
    report = sim.report()
    problem = None if report["outcome"] == "completed" else f"the simulation {report['outcome']}: {(report['error'] or {}).get('message')}"
    return observe_simulation(sim), report["token_efficiency"], problem


def tune(run_dir: Path, *, max_staleness: int | None = None, min_length_bias: float | None = None,
         sweep_steps: int = SWEEP_STEPS, pool: Sequence[Path] = ()) -> TuneResult:
    """Calibrate (decode and trainer time also from the `pool` runs' timelines), validate and (when the replay is close
    enough) sweep and recommend."""
    records = load_run(run_dir)
    pooled = [load_run(other) for other in pool]
    for other in pooled:
        check_poolable(records, other)
    calibration = calibrate(records, pooled)
    tuned_path = write_tuned(run_dir, calibration)
    measured = observe_run(records)
    replay, _, problem = simulate_one(recipe_config(calibration.recipe))
    comparison = compare(measured, replay)
    for other in pooled:
        comparison = _joined(comparison, _replay_pooled(calibration, other), other.run_dir.name)
    if problem is not None:
        comparison = Comparison(comparison.rows, False, [*comparison.reasons, f"the replay of the run's config did not complete: {problem}"])
    if not comparison.ok and calibration.env is not None:
        fitted = json.dumps(calibration.env.simulate_env(), separators=(", ", ": "))
        comparison = Comparison(comparison.rows, False, [*comparison.reasons, ENV_MISSED.format(fitted=fitted)])
    if not comparison.ok:
        return TuneResult(calibration, tuned_path, comparison, [], [], None)
    cfg = records.config
    configs = candidates(cfg.rollout.max_staleness, cfg.rollout.on_stale, cfg.generation.max_inflight, cfg.rollout.groups_per_step,
                         policies_for(cfg.model_dump()), cfg.eval.every_steps)
    points = run_sweep(calibration.recipe, configs, min(sweep_steps, len(records.steps)), simulate_one)
    widest = min(calibration.decode.max_concurrency, cfg.generation.max_inflight)  # spans waiting to retry hold no request slot
    return TuneResult(calibration, tuned_path, comparison, points, frontier(points),
                      recommend(points, max_staleness=max_staleness, min_length_bias=min_length_bias, widest=widest))


def _replay_pooled(calibration: Calibration, other: RunRecords) -> Comparison:
    """A pooled run replayed by the calibrated recipe with that run's settings of the swept keys (and its evaluation cadence
    and step count): its decode and trainer times went into the fits, so it must replay too (runs at different loads do not)."""
    cfg = other.config
    settings = dict(zip(KEYS, (cfg.rollout.max_staleness, cfg.rollout.on_stale, cfg.generation.max_inflight, cfg.rollout.groups_per_step)))
    replay, _, problem = simulate_one(with_overrides(calibration.recipe, {
        **settings, "eval.every_steps": cfg.eval.every_steps, "train.max_steps": len(other.steps)}))
    comparison = compare(observe_run(other), replay)
    if problem is not None:
        return Comparison(comparison.rows, False, [*comparison.reasons, f"the replay did not complete: {problem}"])
    return comparison


def _joined(ours: Comparison, pooled: Comparison, name: str) -> Comparison:
    """`pooled`'s rows and reasons after `ours`, each named with the pooled run's directory."""
    rows = [{**row, "name": f"{name}: {row['name']}"} for row in pooled.rows]
    return Comparison([*ours.rows, *rows], ours.ok and pooled.ok, [*ours.reasons, *(f"pooled run {name}: {r}" for r in pooled.reasons)])


def format_result(result: TuneResult) -> str:
    c = result.calibration
    lines = [
        f"calibrated {result.tuned_path} (run it: asyncgrpo simulate {result.tuned_path}):",
        f"  lengths: prompt median {c.lengths.median:.1f} tokens (sigma {c.lengths.sigma:.2f}), within a group sigma "
        f"{c.lengths.rollout_sigma:.2f}, mean {c.lengths.mean:.1f}, {c.lengths.truncated_share:.0%} cut at their budget"
        + (" (fitted as censored: the lognormal before the cut)" if c.lengths.censored else ""),
        f"  decode: prefill {c.decode.prefill_s * 1e3:.1f} ms, {c.decode.decode_s_per_token * 1e3:.3f} ms/token at full speed, "
        f"full speed up to {c.decode.batch_knee} requests (most open: {c.decode.max_concurrency}; rms error {c.decode.rms_error_s:.3f} s)",
        f"  trainer: {c.trainer.token_time_s * 1e6:.1f} us/token + {c.trainer.overhead_s:.3f} s/step ({c.trainer.step_time_s:.3f} s/step "
        f"on average; per-step line {c.trainer.intercept_s:.3f} s +- {_cell(c.trainer.intercept_se_s)} + {c.trainer.slope_s * 1e6:.1f} "
        f"us/token), weight sync {c.weight_sync_s * 1e3:.1f} ms, evaluation {c.eval_s:.2f} s each (between steps)",
        f"  contention (generation and training on shared hardware): decode {_slowdown(c.decode.contention, c.decode.contention_se)} "
        f"while training, training {_slowdown(c.trainer.contention, c.trainer.contention_se)} while decoding",
        "  faults: " + (", ".join(f"{f['error']} {f['rate']:.2%}" for f in c.faults) or "none"),
        *([] if c.env is None else [
            f"  environment: {c.env.call_median_s * 1e3:.3g} ms per call (median; sigma {c.env.call_sigma:.2f}, "
            f"{c.env.calls} calls), a step ends the episode {c.env.done_prob:.1%} of the time ({c.env.steps} steps; "
            f"by step index {', '.join(f'{p:.1%}' for p in c.env.done_probs)}, the last for every later one), "
            + ("rewards 1.0 " + f"{c.env.reward_prob:.1%}" if c.env.reward_prob is not None else "rewards not all 0 or 1: reward_prob not fitted")
            + ("" if c.env.errors is None else f"; errors {c.env.errors.error_prob:.2%} per call failing the rollout, "
               f"{c.env.errors.transient_prob:.2%} retried")]),
        "validation (the run's config replayed on virtual time):",
        f"  {'':28} {'measured':>14} {'predicted':>14}  check",
    ]
    for row in result.comparison.rows:
        check = "-" if row["ok"] is None else ("ok" if row["ok"] else "MISS")
        lines.append(f"  {row['name']:28} {_cell(row['measured']):>14} {_cell(row['predicted']):>14}  {check}")
    if not result.comparison.ok:
        lines.append("no recommendation: the simulator does not replay this run closely enough to advise from it:")
        lines += [f"  - {reason}" for reason in result.comparison.reasons]
        if any(reason.startswith("pooled run ") for reason in result.comparison.reasons):
            lines.append("  Fix: pool only runs made on this machine at the same load (one just before or after the other, not side by side: "
                         "two runs slow each other), or leave --pool out.")
        elif result.calibration.env is None:  # an episode's reason says its own fix
            lines.append("  Fix: calibrate from a longer run (more steps in its steady state), or read tuned.yaml to see which model is off.")
        return "\n".join(lines)
    lines.append(f"frontier ({len(result.frontier)} of {len(result.points)} configs; none beats these on tokens/s, length bias, "
                 "waste and staleness):")
    lines.append(f"  {'tokens/s':>10} {'bias':>6} {'waste':>6} {'wait':>6}  " + " ".join(k.split('.')[-1] for k in KEYS))
    for p in result.frontier:
        o = p.observed
        assert o is not None
        lines.append(f"  {o.tokens_per_s:>10.1f} {_cell(o.length_bias):>6} {o.waste_share:>6.1%} {o.wait_share:>6.1%}  "
                     + " ".join(str(p.overrides[k]) for k in KEYS))
    skipped = [p for p in result.points if p.problem]
    if skipped:
        lines.append(f"not ranked: {len(skipped)} configs (" + "; ".join(f"{_overrides(p.overrides)}: {p.problem}" for p in skipped[:3]) + ")")
    rec = result.recommendation
    assert rec is not None
    lines.append("recommended: " + (_overrides(rec.changes) if rec.changes else "keep the run's config"))
    lines.append(f"  why: {rec.reason}")
    return "\n".join(lines)


def _slowdown(factor: float, se: float | None) -> str:
    return f"x{factor:.2f} +- {se:.2f}" if se is not None else "x1 (none shown)"


def _overrides(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in overrides.items())


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def plot_frontier(result: TuneResult, path: Path) -> Path:
    """Tokens/s against length bias for every swept config, the frontier marked, each policy its own marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))

    def xy(points: list[Point]) -> tuple[list[float], list[float]]:
        seen = [p.observed for p in points if p.observed is not None]
        return [o.length_bias or 1.0 for o in seen], [o.tokens_per_s for o in seen]

    for policy, marker in zip(POLICIES, "os^Dv<>"):
        ax.scatter(*xy([p for p in result.points if p.overrides["rollout.on_stale"] == policy]), marker=marker, label=policy,
                   facecolors="none", edgecolors="C0")
    ax.scatter(*xy(result.frontier), marker=".", color="C3", label="frontier")
    ax.set_xlabel("length bias (1.0: none)")
    ax.set_ylabel("predicted trained tokens/s")
    ax.set_title("asyncgrpo tune: swept configs and their frontier")
    ax.legend(title="on_stale")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def tune_cli(run_dir: Path, *, as_json: bool, plot: bool, max_staleness: int | None, min_length_bias: float | None,
             pool: Sequence[Path] = ()) -> int:
    result = tune(run_dir, max_staleness=max_staleness, min_length_bias=min_length_bias, pool=pool)
    plotted = plot_frontier(result, run_dir / TUNE_PLOT_FILE) if plot and result.points else None
    if as_json:
        print(json.dumps({**result.to_json(), "plot": None if plotted is None else str(plotted)}))
    else:
        print(format_result(result))
        if plotted is not None:
            print(f"frontier plot: {plotted}")
    return 0 if result.comparison.ok else 1
