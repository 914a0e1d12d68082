"""A real training run freezes what its setup left alive while the pipeline runs (asyncgrpo/commands/gc_pauses.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from tests.unit import test_gc_pauses


@pytest.mark.timeout(300)
def test_the_pipeline_of_a_training_run_runs_with_its_setup_frozen(tmp_path):
    test_gc_pauses.SEEN_FROZEN.clear()
    cfg = load_config("recipes/demo.yaml", [
        f"run.output_dir={tmp_path}", "logging.progress=false", "train.max_steps=2", "rollout.groups_per_step=2",
        "rollout.group_size=4", "eval.every_steps=0", "checkpoint.every_steps=0",
        "reward.functions=[tests.unit.test_gc_pauses:freeze_probe]", "reward.isolation=thread",  # runs in this process
    ])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed", summary.render()
    assert test_gc_pauses.SEEN_FROZEN and min(test_gc_pauses.SEEN_FROZEN) > 0 and gc.get_freeze_count() == 0
