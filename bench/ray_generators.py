"""Steps per second of the demo training with the generators in process (runtime: local), as 1 and 2 Ray actors
(runtime: ray, a local Ray cluster of 2 CPUs started by each run), and with the trainer as 2 data-parallel Ray
ranks (train.world_size: 2) beside 1 or 2 generator actors (CPUs shared out so every row fits the 2 CPUs).

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

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config

SKIP = 5

RAY = ["runtime=ray", "ray.num_cpus=2"]
ROWS = {
    "local (in process)": [],
    "ray, 1 generator actor, trainer in the driver": [*RAY, "ray.generators=1"],
    "ray, 2 generator actors, trainer in the driver": [*RAY, "ray.generators=2"],
    "ray, 1 generator actor, 2 trainer ranks": [*RAY, "ray.generators=1", "train.world_size=2", "ray.trainer.num_cpus=0.5"],
    "ray, 2 generator actors, 2 trainer ranks": [*RAY, "ray.generators=2", "ray.generator.num_cpus=0.5", "train.world_size=2",
                                                 "ray.trainer.num_cpus=0.5"],
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
    print(f"| runtime | steps/s (steps {SKIP + 1}-{steps}) | s/step | vs local | first {SKIP} steps, start included (s) | reward, last 10 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {1 / r['s_per_step']:.2f} | {r['s_per_step']:.3f} | {base / r['s_per_step']:.2f}x | {r['first_steps_s']:.1f} "
              f"| {r['reward_last10']:.3f} |")


if __name__ == "__main__":
    main()
