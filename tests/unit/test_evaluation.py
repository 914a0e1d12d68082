"""Evaluation's numbers: the mean reward, each reward function's mean (`eval/reward/<function>`) and pass@k,
over samples from a generator that answers each held-out prompt with a fixed text."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.config import load_config
from asyncgrpo.evaluation import evaluate
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.types import Completion, GenerationRequest, Prompt

ANSWERS = {0: "12", 1: "7 + 5 = 12", 2: "I do not know"}


class Answers:
    """A generator answering prompt `i` with ANSWERS[i] (one token per character; no model needed)."""

    name = "answers"
    serving_version = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        text = ANSWERS[request.prompt_id]
        return Completion((1,) * len(text), (0.0,) * len(text), (0,) * len(text), "stop", 0, text=text)


def correct(prompts, completions, **_):
    return [1.0 if c.split()[-1] == "12" else 0.0 for c in completions]


def only_a_number(prompts, completions, **_):
    return [1.0 if c.isdigit() else 0.0 for c in completions]


def test_each_reward_functions_mean_is_reported_beside_the_weighted_total_and_the_pass_rate():
    cfg = load_config(None, ["eval.samples_per_prompt=2", "eval.success_threshold=1.5", "eval.temperature=0.0"])
    prompts = [Prompt(i, f"question {i}", (1, 2, 3)) for i in ANSWERS]

    async def run():
        async with RewardScorer([("correct", correct), ("only_a_number", only_a_number)], [1.0, 0.5]) as scorer:
            return await evaluate(cfg, Answers(), scorer, prompts, (), step=3)  # type: ignore[arg-type]

    metrics = asyncio.run(run())
    assert metrics["eval/reward/correct"] == pytest.approx(2 / 3) and metrics["eval/reward/only_a_number"] == pytest.approx(1 / 3)
    assert metrics["eval/reward_mean"] == pytest.approx(2 / 3 + 0.5 / 3)  # the weighted total of the two means
    assert metrics["eval/pass_rate"] == pytest.approx(1 / 3) and metrics["eval/failed_requests"] == 0  # only "12" earns 1.5
