"""Train shipped recipes and print what each learned: the held-out curve from start to end, and the wall time.

    python bench/recipe_curves.py local_model demo      # recipes/<name>.yaml, in a scratch directory
    python bench/recipe_curves.py local_model --keep runs/curves

Job: produce the numbers of docs/benchmarks.md, "Recipes that learn". Each recipe runs as a user runs it
(`python -m asyncgrpo.commands.cli train recipes/<name>.yaml`, from a scratch directory holding `recipes/` and, for
local_model, `runs/tiny_model` written by `python -m asyncgrpo.models.tiny` as the README says), with
`logging.progress=false` and nothing else changed. It prints one markdown row per recipe: the curve metric
(`eval/reward_mean` at every evaluation where it changed, or for a distillation recipe, which has no eval,
`distill/kl_mean` as the mean of each block of 10 steps), and the wall time of the whole command. A run that fails prints its stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def curve(run_dir: Path) -> tuple[str, list[tuple[int, float]]]:
    """(metric, [(step, value)]) of a finished run: eval/reward_mean where it changes, else distill/kl_mean as the
    mean of each block of 10 steps (labelled by the block's first step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals: list[tuple[int, float]] = []
    for row in rows:
        value = row.get("eval/reward_mean")
        if value is not None and (not evals or evals[-1][1] != value):
            evals.append((int(row["step"]), float(value)))
    if evals:
        return "eval/reward_mean", evals
    blocks: dict[int, list[float]] = {}
    for row in rows:
        if row.get("distill/kl_mean") is not None:
            blocks.setdefault(int(row["step"]) // 10 * 10, []).append(float(row["distill/kl_mean"]))
    if blocks:
        return "distill/kl_mean, mean per 10 steps", [(step, sum(v) / len(v)) for step, v in sorted(blocks.items())]
    raise SystemExit(f"{run_dir / 'metrics.jsonl'} has neither eval/reward_mean nor distill/kl_mean")


def run_recipe(name: str, workdir: Path) -> tuple[float, Path]:
    """Train recipes/<name>.yaml in `workdir`; (wall seconds, run directory)."""
    if name == "local_model" and not (workdir / "runs" / "tiny_model").is_dir():
        subprocess.run([sys.executable, "-m", "asyncgrpo.models.tiny", "runs/tiny_model"], cwd=workdir, check=True,
                       capture_output=True)
    run_dir = workdir / "runs" / name
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.commands.cli", "train", f"recipes/{name}.yaml", f"run.output_dir={run_dir}",
         "logging.progress=false"],
        cwd=workdir, capture_output=True, text=True,
    )
    wall = time.monotonic() - started
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        raise SystemExit(f"recipes/{name}.yaml failed with exit code {result.returncode}")
    return wall, run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="+", help="recipe names (recipes/<name>.yaml)")
    parser.add_argument("--keep", type=Path, default=None, help="work in this directory and keep the runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="recipe-curves-") as scratch:
        workdir = (args.keep or Path(scratch)).resolve()
        (workdir / "recipes").mkdir(parents=True, exist_ok=True)
        print("| recipe | metric | step: value | wall s |\n| --- | --- | --- | --- |")
        for name in args.recipes:
            source = ROOT / "recipes" / f"{name}.yaml"
            if not source.is_file():
                raise SystemExit(f"no recipe {source}; the names are {sorted(p.stem for p in source.parent.glob('*.yaml'))}")
            (workdir / "recipes" / source.name).write_text(source.read_text())
            wall, run_dir = run_recipe(name, workdir)
            metric, points = curve(run_dir)
            shown = ", ".join(f"{step}: {value:.3f}" for step, value in points)
            print(f"| {name} | {metric} | {shown} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
