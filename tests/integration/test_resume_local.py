"""`rollout.on_stale: resume` on the local engine, end to end with the demo's tiny model: it continues rollouts in place
(weights installed between decoding steps, each token stamped with its version), so nothing is interrupted, and the
trainer trains the per-token masks the policy sets."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


@pytest.mark.timeout(300)
def test_resume_trains_on_the_local_engine_in_place(tmp_path):
    cfg = load_config("recipes/demo.yaml", [f"run.output_dir={tmp_path}", "logging.progress=false", "rollout.on_stale=resume",
                                            "rollout.max_staleness=1", "train.max_steps=6", "rollout.groups_per_step=3",
                                            "rollout.group_size=4", "eval.every_steps=0", "checkpoint.every_steps=0"])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed" and summary.result.steps == 6
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6 and max(m["staleness/max"] for m in metrics) <= 1  # the oldest trained token, per step
    assert all(m["rollout/resumed_rollouts_total"] == 0 for m in metrics)  # in place: no interruption
    last = metrics[-1]
    assert last["rollout/generated_tokens_total"] >= last["rollout/trained_tokens_total"] + last["rollout/masked_stale_tokens_total"]
    assert all(m["rollout/trained_version_span"] >= 0 for m in metrics)
