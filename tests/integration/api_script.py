"""A training script as a TRL user writes one, run as a subprocess by test_python_api.py.

Usage: python api_script.py RUN_DIR MAX_STEPS. The reward is a function of this script (``__main__``:
it runs in threads), the data a `datasets.Dataset`. Prints one JSON line on stdout: what `train()` gave
(`raised` names the KeyboardInterrupt when Ctrl-C stopped it, which is then re-raised).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets

import asyncgrpo
from asyncgrpo.tasks import TASKS


def says_the_letter(prompts, completions, letter, **kwargs):
    return [1.0 if completion.strip().startswith(want) else 0.0 for completion, want in zip(completions, letter)]


def report(result: asyncgrpo.Result, raised: str | None) -> str:
    return json.dumps({
        "raised": raised, "outcome": result.outcome, "stopped_by": result.stopped_by, "steps": result.steps,
        "metrics_steps": [m["step"] for m in result.metrics], "reward_keys": sorted(k for k in result.metrics[0] if k.startswith("reward/")),
        "checkpoint": str(result.final_checkpoint),
    })


def main() -> None:
    run_dir, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    task = TASKS["repeat_letter"]
    trainer = asyncgrpo.Trainer(
        model="builtin:tiny",
        reward_funcs=[says_the_letter],
        train_dataset=datasets.Dataset.from_list(task.rows(256, 0)),
        eval_dataset=task.eval_rows(8, 0),
        config=Path(__file__).resolve().parents[2] / "recipes" / "demo.yaml",
        **{"run.output_dir": str(run_dir), "train.max_steps": max_steps, "train.warmup_steps": 0, "eval.every_steps": 2,
           "eval.num_prompts": 8, "checkpoint.every_steps": 0, "logging.progress": False, "rollout.groups_per_step": 2},
    )
    try:
        result = trainer.train()
    except KeyboardInterrupt as exc:
        print(report(exc.result, type(exc).__name__), flush=True)  # type: ignore[attr-defined]
        raise
    print(report(result, None), flush=True)


if __name__ == "__main__":
    main()
