"""recipes/agent_calculator.yaml on the real train path: the agent's real openai client, the run's gateway on 127.0.0.1,
builtin:tiny's tokenizer and local engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


@pytest.mark.timeout(300)
def test_the_agent_recipe_trains_through_the_gateway(tmp_path):
    cfg = load_config("recipes/agent_calculator.yaml", [
        f"run.output_dir={tmp_path}", "logging.progress=false", "eval.every_steps=0", "checkpoint.every_steps=0", "train.max_steps=2",
        "train.warmup_steps=0", "rollout.groups_per_step=1", "rollout.group_size=4", "generation.max_inflight=4",
    ])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        assert m["reward/env"] is not None and m["env/turns_mean"] >= 1
        assert m["env/errors_total"] == m["env/abandoned_total"] == 0
        assert all(v == 0 for k, v in m.items() if k.startswith("agent/failed/"))
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all("assistant: " in s["completion"] for s in samples)
