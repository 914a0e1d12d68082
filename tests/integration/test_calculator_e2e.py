"""recipes/calculator.yaml on the real train path: the tiny model learns to call the calculator (the tool-use reward
rises and episodes get their second turn), the same recipe runs with env.isolation: process, and its held-out
evaluation plays the questions as episodes."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


def run(tmp_path, *overrides: str):
    cfg = load_config("recipes/calculator.yaml", [
        f"run.output_dir={tmp_path}", "logging.progress=false", "eval.every_steps=0", "checkpoint.every_steps=0", *overrides,
    ])
    summary = asyncio.run(train(cfg))
    assert summary.result.outcome == "completed"
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_the_tiny_model_learns_to_call_the_calculator(tmp_path):
    # Synchronous: the same run every time. The reward saturates near its 0.2 ceiling by step 30 (a 40-step run: last 5
    # steps' mean - first 5's = 0.161 at step 30, 0.174 at step 40; turns 0.84 and 0.90), so steps past 30 showed nothing.
    metrics = run(tmp_path, "rollout.max_staleness=0", "train.max_steps=30")
    rewards = [m["reward/env"] for m in metrics]
    turns = [m["env/turns_mean"] for m in metrics]
    # The tiny model never answers right in this time, so the environment's reward is the tool-use term:
    # 0.2 x the share of episodes whose first turn is a call that computes.
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > first + 0.08, f"the tool-use reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert statistics.fmean(turns[-5:]) > statistics.fmean(turns[:5]) + 0.3  # a call is followed by a second turn
    assert all(m["env/errors_total"] == 0 and m["env/abandoned_total"] == 0 for m in metrics)


@pytest.mark.timeout(300)
def test_the_calculator_recipe_runs_with_process_isolation(tmp_path):
    metrics = run(tmp_path, "env.isolation=process", "train.max_steps=2", "rollout.groups_per_step=2", "rollout.group_size=4")
    assert len(metrics) == 2
    assert all(m["env/errors_total"] == 0 and m["env/abandoned_total"] == 0 and m["reward/env"] is not None for m in metrics)


@pytest.mark.timeout(300)
def test_the_calculator_recipes_evaluation_plays_held_out_questions_as_episodes(tmp_path):
    metrics = run(tmp_path, "train.max_steps=2", "rollout.groups_per_step=2", "rollout.group_size=4", "eval.every_steps=1",
                  "eval.num_prompts=8")
    assert len(metrics) == 2
    for m in metrics:  # the environment's reward is the only term: an episode's reward is its env reward
        assert m["eval/failed_requests"] == 0 and m["eval/pass_rate"] is not None and m["eval/reward/env"] is not None
        assert m["eval/reward_mean"] == pytest.approx(m["eval/reward/env"])
