"""Does `rollout.on_stale: resume` learn as well per trained token as `patience`? (issue 23 item 6)

Trains recipes/demo.yaml (builtin:tiny learns repeat_letter, local engine) under each policy with the same seeds, on a
workload where groups do go stale: the demo as shipped leaves no group behind (its admission window keeps every group
trainable), so this one admits `--over-admit` groups beyond the window (`rollout.over_admit_groups`, with
`generation.max_inflight` and the engine's batch raised to hold them), and the slowest groups race past the bound.
Everything else is the recipe's. For every run it prints the held-out curve (`eval/reward_mean` at each evaluation)
against the tokens trained so far, and what the policy did with the tokens: generated, trained, wasted (thrown away as
stale), masked (kept in the context, out of the loss: `resume`), stale groups and the widest version span of a
trained rollout. Then the mean curve per policy over the seeds. Runs are sequential, one process each, in a scratch
directory (`--keep DIR` keeps them, and a later call with the same DIR reads a run that finished all its steps there
instead of training it again: add seeds to a table); timing decides which groups go stale, so a rerun differs in detail.

    python bench/staleness_learning.py [--seeds 0,1,2] [--steps 100] [--eval-every 25] [--over-admit 8] [--policies "patience;resume"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {
    "patience": ["rollout.on_stale=patience"],
    "resume": ["rollout.on_stale=resume"],
    # a group with any token past the bound is stale as a whole: resume without training beside masked tokens
    "resume, masked share 0": ["rollout.on_stale=resume", "rollout.max_masked_share=0"],
}


def workload(steps: int, eval_every: int, over_admit: int) -> list[str]:
    """The demo's overrides: its length, its evaluations, and `over_admit` groups of 8 beyond the window, with request
    slots and one engine wave for all of them (K = 1: (K + 1) * 8 groups of 8 in the window)."""
    inflight = (16 + over_admit) * 8
    return [f"train.max_steps={steps}", f"eval.every_steps={eval_every}", f"checkpoint.every_steps={steps}",
            f"rollout.over_admit_groups={over_admit}", f"generation.max_inflight={inflight}",
            f"generation.local.max_batch_size={inflight}", "logging.progress=false"]


def train(run_dir: Path, overrides: list[str]) -> float:
    """Train the demo into `run_dir` with `overrides`; the wall seconds."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "asyncgrpo.commands.cli", "train", str(ROOT / "recipes/demo.yaml"),
                             f"run.output_dir={run_dir}", *overrides], capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        raise SystemExit(f"the run {run_dir.name} failed with exit code {result.returncode}")
    return time.monotonic() - started


def finished(run_dir: Path, steps: int) -> bool:
    """Has `run_dir` a run that trained all `steps` steps (a line per step in its metrics)?"""
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= steps


def summary(run_dir: Path, eval_every: int) -> dict[str, Any]:
    """The held-out curve [(steps trained, tokens trained, eval/reward_mean)] and the token books at the end of a finished
    run. Every line carries the newest evaluation's value: the baseline's (before any training) until the first
    `eval_every` steps are trained, then each `eval_every`-th step's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(0, 0, float(rows[0]["eval/reward_mean"]))] if eval_every > 1 else []
    curve += [(int(r["step"]) + 1, int(r["rollout/trained_tokens_total"]), float(r["eval/reward_mean"]))
              for r in rows if (int(r["step"]) + 1) % eval_every == 0]
    last = rows[-1]
    return {
        "curve": curve,
        "generated": last["rollout/generated_tokens_total"], "trained": last["rollout/trained_tokens_total"],
        "wasted": last["rollout/wasted_tokens_total"], "masked": last["rollout/masked_stale_tokens_total"],
        "stale_groups": last["rollout/stale_groups_total"],
        "span": max(int(r["rollout/trained_version_span"]) for r in rows),
    }


def curve_text(curve: list[tuple[int, int, float]]) -> str:
    return ", ".join(f"{step}: {value:.3f} ({tokens / 1000:.0f}k)" for step, tokens, value in curve)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="run.seed values, comma-separated (each policy runs each)")
    parser.add_argument("--steps", type=int, default=100, help="train.max_steps")
    parser.add_argument("--eval-every", type=int, default=25, help="eval.every_steps")
    parser.add_argument("--over-admit", type=int, default=8, help="rollout.over_admit_groups")
    parser.add_argument("--policies", default="patience;resume", help=f"semicolon-separated, of {list(POLICIES)}")
    parser.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them (finished ones are read, not rerun)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    policies = [p.strip() for p in args.policies.split(";") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        raise SystemExit(f"--policies: unknown {unknown}; the policies are {list(POLICIES)}")
    if args.steps < 1 or args.eval_every < 1 or args.over_admit < 0:
        raise SystemExit(f"--steps {args.steps} and --eval-every {args.eval_every} must be >= 1 and --over-admit "
                         f"{args.over_admit} >= 0")
    common = workload(args.steps, args.eval_every, args.over_admit)
    print("| policy | seed | held-out eval/reward_mean after N steps (tokens trained by then) | generated tokens | trained share | "
          "wasted share | masked share | stale groups | version span | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    with tempfile.TemporaryDirectory(prefix="staleness-learning-") as scratch:
        base = (args.keep or Path(scratch)).resolve()
        for seed in seeds:
            for policy in policies:
                run_dir = base / f"{policy.replace(', ', '-').replace(' ', '-')}-seed{seed}"
                wall = None if finished(run_dir, args.steps) else train(run_dir, [*common, f"run.seed={seed}", "run.overwrite=true",
                                                                                   *POLICIES[policy]])
                s = summary(run_dir, args.eval_every)
                results[policy].append(s)
                g = s["generated"]
                print(f"| {policy} | {seed} | {curve_text(s['curve'])} | {g} | {s['trained'] / g:.1%} | {s['wasted'] / g:.1%} | "
                      f"{s['masked'] / g:.1%} | {s['stale_groups']} | {s['span']} | {'read' if wall is None else f'{wall:.0f}'} |", flush=True)
    for policy, runs in results.items():
        points = zip(*(r["curve"] for r in runs))
        mean = [(p[0][0], round(statistics.mean(t for _, t, _ in p)), statistics.mean(v for _, _, v in p)) for p in points]
        generated = statistics.mean(r["generated"] for r in runs)
        print(f"| {policy} | mean of {len(runs)} | {curve_text(mean)} | {generated:.0f} | "
              f"{statistics.mean(r['trained'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['wasted'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['masked'] for r in runs) / generated:.1%} | "
              f"{statistics.mean(r['stale_groups'] for r in runs):.0f} | {max(r['span'] for r in runs)} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
