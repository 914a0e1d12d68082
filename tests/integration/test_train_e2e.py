"""The real `train` path end to end: the tiny model learns (asserted once, seeded and synchronous),
and with staleness 0, 1 and 2 the run keeps the pipeline's invariants on real threads."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading

import pytest
from transformers import AutoModelForCausalLM

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


def run(tmp_path, *overrides: str):
    cfg = load_config("recipes/demo.yaml", [f"run.output_dir={tmp_path}", "logging.progress=false", *overrides])
    threads_before = set(threading.enumerate())
    summary = asyncio.run(train(cfg))
    leftover = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert leftover == [], f"threads left running: {leftover}"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return cfg, summary, metrics


@pytest.mark.timeout(600)
def test_synchronous_grpo_learns_the_demo_task(tmp_path):
    cfg, summary, metrics = run(
        tmp_path,
        "rollout.max_staleness=0",
        "train.max_steps=80",
        "train.lr_schedule=constant",  # the rate this 80-step learning check was calibrated with (the recipe decays to 0)
        "rollout.groups_per_step=6",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    )
    assert summary.result.outcome == "completed" and summary.result.steps == 80
    rewards = [m["reward/mean"] for m in metrics]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert last > first + 0.15, f"reward did not improve: first 10 steps {first:.3f}, last 10 steps {last:.3f}"
    assert all(m["staleness/max"] == 0 for m in metrics)  # max_staleness 0 is on-policy
    assert all(m["generation/session_moves_total"] is None for m in metrics)  # the local engine keeps no server totals
    # The final checkpoint loads with plain transformers.
    model = AutoModelForCausalLM.from_pretrained(summary.final_checkpoint, local_files_only=True)
    assert model.num_parameters() > 500_000


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_the_train_path_keeps_the_invariants_at_each_staleness(tmp_path, staleness):
    cfg, summary, metrics = run(
        tmp_path,
        f"rollout.max_staleness={staleness}",
        "train.max_steps=6",
        "rollout.groups_per_step=3",
        "rollout.group_size=4",
        "eval.every_steps=3",
        "eval.num_prompts=4",
        "checkpoint.every_steps=3",
    )
    assert summary.result.outcome == "completed" and summary.result.steps == 6
    acc = summary.accounting
    assert acc["taken"] == acc["trained"] + acc["requeued"] + sum(acc["dropped"].values()) + acc["in_flight"] + acc["buffered"]
    assert acc["trained"] == 18
    assert len(metrics) == 6 and all(set(m) == set(metrics[0]) for m in metrics)
    assert max(m["staleness/max"] for m in metrics) <= staleness
    assert all(m["eval/reward_mean"] is not None for m in metrics)  # the baseline eval fills step 0
    assert all(m["rollout/failed_total"] == 0 for m in metrics)
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "samples.jsonl").read_text()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000006"]


@pytest.mark.timeout(300)
def test_a_jsonl_source_trains_until_the_data_runs_out_and_holds_out_its_eval_rows(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {c}: ", "letter": c}) + "\n" for c in "abcde" * 4))
    cfg, summary, metrics = run(
        tmp_path / "run",
        f"data.source={data}",
        "eval.every_steps=2",
        "eval.num_prompts=4",
        "rollout.groups_per_step=4",
        "rollout.group_size=4",
        "train.max_steps=100",
    )
    assert summary.result.outcome == "completed" and summary.result.stop_reason == "data_exhausted"
    assert summary.accounting["trained"] == 16  # 20 rows, the last 4 held out for eval
    assert "the data ran out" in summary.render()
    assert len(metrics) == 4 and metrics[-1]["eval/reward_mean"] is not None
