"""Seconds per step of the demo training with the generators in process (runtime: local) and as 1 and 2
Ray actors (runtime: ray, a local Ray cluster of 2 CPUs started by each run).

Same recipe, seed and step count for each row. The first 5 steps are left out of the time per step,
so the Ray cluster's start (a few seconds) is not counted; it is reported on its own. Absolute
numbers move with the machine's load; on a 2-core machine the actors and the trainer share the cores.

    .venv/bin/python bench/ray_generators.py [steps]
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from asyncgrpo.config import load_config
from asyncgrpo.train import train

SKIP = 5

ROWS = {
    "local (in process)": [],
    "ray, 1 generator actor": ["runtime=ray", "ray.generators=1", "ray.num_cpus=2"],
    "ray, 2 generator actors": ["runtime=ray", "ray.generators=2", "ray.num_cpus=2"],
}


def measure(overrides: list[str], steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            "recipes/demo.yaml",
            [f"run.output_dir={tmp}", "logging.progress=false", f"train.max_steps={steps}", "eval.every_steps=0",
             "checkpoint.every_steps=0", *overrides],
        )
        asyncio.run(train(cfg))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["time/elapsed_s"] for r in rows]
    return {
        "s_per_step": (elapsed[-1] - elapsed[SKIP - 1]) / (len(rows) - SKIP),
        "first_steps_s": elapsed[SKIP - 1],
        "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    results = {name: measure(overrides, steps) for name, overrides in ROWS.items()}
    base = results["local (in process)"]["s_per_step"]
    print(f"| generators | s/step (steps {SKIP + 1}-{steps}) | vs local | first {SKIP} steps, start included (s) | reward, last 10 |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['s_per_step']:.3f} | {base / r['s_per_step']:.2f}x | {r['first_steps_s']:.1f} | {r['reward_last10']:.3f} |")


if __name__ == "__main__":
    main()
