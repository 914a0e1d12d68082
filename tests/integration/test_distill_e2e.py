"""`algorithm: distill` end to end on the real train path: the tiny student's KL to a tiny teacher falls
(asserted once, seeded and synchronous), and the teacher's thread ends with the run."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config
from asyncgrpo.errors import ConfigError


@pytest.mark.timeout(600)
def test_a_short_distillation_run_lowers_the_student_teacher_kl(tmp_path):
    cfg = load_config("recipes/distill_tiny.yaml", [f"run.output_dir={tmp_path}", "rollout.max_staleness=0", "train.max_steps=40"])
    threads_before = set(threading.enumerate())
    summary = asyncio.run(train(cfg))
    assert [t for t in set(threading.enumerate()) - threads_before if t.is_alive()] == []
    assert summary.result.outcome == "completed" and summary.result.steps == 40
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [m["distill/kl_mean"] for m in metrics]
    first, last = statistics.fmean(kl[:8]), statistics.fmean(kl[-8:])
    assert last < 0.7 * first, f"distill/kl_mean did not fall: first 8 steps {first:.4f}, last 8 steps {last:.4f}"
    assert all(m["staleness/max"] == 0 for m in metrics)
    assert summary.accounting["trained"] == 40 * cfg.rollout.groups_per_step  # one sample per unit


def test_a_teacher_path_that_does_not_exist_is_refused_before_anything_loads(tmp_path):
    overrides = [f"run.output_dir={tmp_path}", "train.max_steps=1"]
    with pytest.raises(ConfigError, match="distill.teacher = 'no/such/dir': no such directory"):
        asyncio.run(train(load_config("recipes/distill_tiny.yaml", [*overrides, "distill.teacher=no/such/dir"])))
