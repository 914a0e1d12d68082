"""The real `train` path with a multi-turn environment: builtin:tiny plays episodes of tests.envs:AsyncEcho on the
local engine, the torch trainer trains their model tokens, and the run keeps its invariants."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


@pytest.mark.timeout(300)
def test_a_short_run_of_the_tiny_model_on_a_toy_environment(tmp_path):
    cfg = load_config("recipes/demo.yaml", [
        f"run.output_dir={tmp_path}", "logging.progress=false", "train.max_steps=3", "rollout.groups_per_step=2",
        "rollout.group_size=4", "eval.every_steps=0", "checkpoint.every_steps=0", "reward.functions=[]",
        "env.factory=tests.envs:AsyncEcho", "env.max_turns=2", "env.max_tokens=40",
    ])
    threads_before = set(threading.enumerate())
    summary = asyncio.run(train(cfg))
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert leftover == [], f"threads left running: {leftover}"
    assert summary.result.outcome == "completed" and summary.result.steps == 3
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for m in metrics:
        assert 1.0 <= m["env/turns_mean"] <= 2.0
        assert m["reward/env"] is not None and m["env/errors_total"] == 0 and m["env/abandoned_total"] == 0
        assert m["loss"] is not None
