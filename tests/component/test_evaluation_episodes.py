"""Evaluation with an env: section plays each held-out prompt as an episode through the environment, as training does:
the calculator environment's reward is reported as eval/reward/env and decides the pass rate; an environment that
raises leaves its sample out (eval/failed_requests) instead of failing the run; and a cancelled evaluation, or an
episode past its time limit, leaves no environment worker behind (env.isolation: process)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from asyncgrpo import evaluation
from asyncgrpo.data.loading import build_prompts, read_eval_rows
from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.evaluation import evaluate
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.types import Completion, GenerationRequest, Prompt
from tests.component.test_process_episodes import ticks
from tests.component.test_process_host import alive, group_members
from tests.sim.fakes import Fate, ProgrammedGenerator, recipe

pytestmark = pytest.mark.timeout(120)
CODEC = CharCodec()


def calculator_recipe(**env: object):
    return recipe(
        data={"source": "builtin:calculator"},
        env={"factory": "asyncgrpo.environments.calculator:CalculatorEnv", "observation_role": "tool", "max_turns": 2,
             "cancel_grace_s": 0.2, **env},
        reward={"functions": []},
        eval={"every_steps": 1, "num_prompts": 6},
    )


def held_out(cfg) -> list[Prompt]:
    rows = read_eval_rows(cfg.data.source, n=cfg.eval.num_prompts, seed=0, key="data.source")
    return build_prompts(rows, prompt_key="prompt", tokenizer=None, max_prompt_tokens=256)[0]


class CallsThenAnswers:
    """Turn 0 calls the calculator ("=", the question's own expression); turn 1 answers: right for even prompt ids,
    wrong ("1") for odd ones. One id per character (the codec's)."""

    name = "calls-then-answers"
    serving_version = 0

    def __init__(self, prompts: list[Prompt]) -> None:
        self.answers = {p.id: p.columns["answer"] for p in prompts}
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> Completion:
        self.requests.append(request)
        turn = int(request.request_id.rsplit("-t", 1)[1])
        text = "=" if turn == 0 else self.answers[request.prompt_id] if request.prompt_id % 2 == 0 else "1"
        ids = CODEC.encode(text)
        return Completion(ids, (-1.0,) * len(ids), (0,) * len(ids), "stop", 0, text=text)


def contains(ids: tuple[int, ...], part: tuple[int, ...]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def evaluated(cfg, generator, prompts):
    async with RewardScorer.from_config(cfg.reward, isolation="inline") as scorer:
        async with asyncio.timeout(60):
            return await evaluate(cfg, generator, scorer, prompts, (), step=0, codec=CODEC)


def test_each_held_out_prompt_is_played_as_an_episode_and_scored_by_the_environment():
    cfg = calculator_recipe()
    prompts = held_out(cfg)
    generator = CallsThenAnswers(prompts)
    metrics = asyncio.run(evaluated(cfg, generator, prompts))
    # Every episode: a call that computes (tool-use term 0.2), then the answer (1.0 when right: the even prompts).
    assert metrics["eval/reward/env"] == pytest.approx(0.2 + 0.5) and metrics["eval/reward_mean"] == pytest.approx(0.7)
    assert metrics["eval/pass_rate"] == pytest.approx(0.5) and metrics["eval/failed_requests"] == 0
    # Two turns per prompt, greedy (eval.temperature), the second one's context carrying the calculator's result.
    assert sorted(r.request_id for r in generator.requests) == sorted(f"eval-0-{p.id}-0-t{t}" for p in prompts for t in (0, 1))
    assert all(r.sampling.temperature == 0.0 for r in generator.requests)
    for request in (r for r in generator.requests if r.request_id.endswith("-t1")):
        assert contains(request.prompt_token_ids, CODEC.encode(f"= {generator.answers[request.prompt_id]}"))


class BreaksOnOddAnswers:
    """The calculator, except that its step raises for questions whose answer is odd."""

    def reset(self, row):
        self.answer = int(row["answer"])
        return None

    def step(self, action_text):
        if self.answer % 2:
            raise ValueError("the tool crashed")
        return "fine", 1.0, True, {}

    def close(self):
        pass


def test_an_environment_that_raises_during_evaluation_leaves_its_sample_out_with_one_warning(caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    cfg = calculator_recipe(factory="tests.component.test_evaluation_episodes:BreaksOnOddAnswers")
    prompts = held_out(cfg)
    odd = sum(int(p.columns["answer"]) % 2 for p in prompts)
    assert 0 < odd < len(prompts)
    metrics = asyncio.run(evaluated(cfg, CallsThenAnswers(prompts), prompts))
    assert metrics["eval/failed_requests"] == odd
    assert metrics["eval/reward/env"] == 1.0 and metrics["eval/pass_rate"] == 1.0  # over the samples that were had
    warnings = [r.getMessage() for r in caplog.records if "is incomplete" in r.getMessage()]
    assert len(warnings) == 1 and f"{odd} of {len(prompts)} samples failed" in warnings[0] and "the tool crashed" in warnings[0]


def ticking_recipe(tmp_path, monkeypatch, step_timeout_s: float = 60.0, **generation: object):
    monkeypatch.setenv("TICKS_DIR", str(tmp_path))
    cfg = recipe(
        env={"factory": "tests.component.test_process_episodes:Ticking", "isolation": "process", "cancel_grace_s": 0.2, "max_turns": 1,
             "step_timeout_s": step_timeout_s},
        reward={"functions": []},
        eval={"every_steps": 1, "num_prompts": 2},
        generation=generation,
    )
    prompts = [Prompt(i, f"question {i}", (1, 2, 3)) for i in range(2)]
    return cfg, prompts, ProgrammedGenerator(lambda request, attempt: Fate(after_s=0.001, tokens=3))


def assert_stopped_and_gone(tmp_path, at_end: dict[int, int]) -> None:
    assert len(at_end) == 2
    for pid in at_end:  # each worker is its process group's leader
        assert not alive(pid) and group_members(pid) == []
    time.sleep(0.1)
    assert ticks(tmp_path) == at_end  # the environments' side effects stopped moving


def test_cancelling_an_evaluation_stops_its_episodes_and_leaves_no_worker(tmp_path, monkeypatch):
    cfg, prompts, generator = ticking_recipe(tmp_path, monkeypatch)

    async def main():
        async with RewardScorer.from_config(cfg.reward, isolation="inline") as scorer:
            evaluation = asyncio.create_task(evaluate(cfg, generator, scorer, prompts, (), step=0, codec=CODEC))
            async with asyncio.timeout(60):
                while len(ticks(tmp_path)) < 2 or min(ticks(tmp_path).values()) < 3:  # both episodes are in step
                    await asyncio.sleep(0.01)
                evaluation.cancel()  # the run stopping
                with pytest.raises(asyncio.CancelledError):
                    await evaluation
        return ticks(tmp_path)

    assert_stopped_and_gone(tmp_path, asyncio.run(main()))


def test_an_evaluation_episode_past_its_time_limit_is_stopped_and_counted_failed(tmp_path, monkeypatch):
    # The episode's time limit (config.episode_limit_s) guards what the calls' own deadlines do not add up to (transient
    # retries); here it is 5 s (room for a worker process's start on a loaded machine) while the step's deadline is an
    # hour, so the limit stops the episodes stuck in step.
    monkeypatch.setattr(evaluation, "episode_limit_s", lambda env, generation: 5.0)
    cfg, prompts, generator = ticking_recipe(tmp_path, monkeypatch, step_timeout_s=3600.0)

    async def main():
        async with RewardScorer.from_config(cfg.reward, isolation="inline") as scorer:
            async with asyncio.timeout(60):
                return await evaluate(cfg, generator, scorer, prompts, (), step=0, codec=CODEC), ticks(tmp_path)

    metrics, at_end = asyncio.run(main())
    assert metrics["eval/failed_requests"] == 2 and metrics["eval/reward_mean"] is None and metrics["eval/pass_rate"] is None
    assert_stopped_and_gone(tmp_path, at_end)


def test_an_evaluation_episode_past_its_step_deadline_is_stopped_and_counted_failed(tmp_path, monkeypatch):
    # env.step_timeout_s 5: the episodes, stuck in step, are stopped after 5 s (their worker killed after the grace). The
    # reset, a worker process's start included, has the same deadline: 5 s leaves it room on a loaded machine.
    cfg, prompts, generator = ticking_recipe(tmp_path, monkeypatch, step_timeout_s=5.0, rollout_deadline_s=1.0, request_timeout_s=1.0)

    async def main():
        async with RewardScorer.from_config(cfg.reward, isolation="inline") as scorer:
            async with asyncio.timeout(60):
                return await evaluate(cfg, generator, scorer, prompts, (), step=0, codec=CODEC), ticks(tmp_path)

    metrics, at_end = asyncio.run(main())
    assert metrics["eval/failed_requests"] == 2 and metrics["eval/reward_mean"] is None and metrics["eval/pass_rate"] is None
    assert_stopped_and_gone(tmp_path, at_end)
