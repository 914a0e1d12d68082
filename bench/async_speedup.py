"""Wall time per step of the real demo training at staleness 0 (synchronous), 1 and 2, in one run.

Same recipe, seed and step count for each K; reports seconds per step, the share of the time
the trainer waited for data, and the reward reached, so the ratio between rows is comparable
(absolute numbers move with the machine's load).

    .venv/bin/python bench/async_speedup.py [steps]
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


def measure(k: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            "recipes/demo.yaml",
            [f"run.output_dir={tmp}", "logging.progress=false", f"rollout.max_staleness={k}", f"train.max_steps={steps}",
             "eval.every_steps=0", "checkpoint.every_steps=0"],
        )
        asyncio.run(train(cfg))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    elapsed = rows[-1]["time/elapsed_s"]
    waited = sum(r["time/trainer_wait_s"] for r in rows)
    return {
        "s_per_step": elapsed / len(rows),
        "wait_share": waited / elapsed,
        "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    results = {k: measure(k, steps) for k in (0, 1, 2)}
    base = results[0]["s_per_step"]
    print(f"| max_staleness | s/step | speed-up vs K=0 | trainer waiting | reward, last 10 of {steps} steps |")
    print("| --- | --- | --- | --- | --- |")
    for k, r in results.items():
        print(f"| {k} | {r['s_per_step']:.3f} | {base / r['s_per_step']:.2f}x | {r['wait_share']:.0%} | {r['reward_last10']:.3f} |")


if __name__ == "__main__":
    main()
