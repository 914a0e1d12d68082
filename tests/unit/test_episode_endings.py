"""The bounded, named endings of an episode (rollout/episode.py) with thread-hosted environments (tests/envs.py):
observations sized before they are tokenized, and tokenized off the event loop; a step's own deadline
(env.step_timeout_s); user code that raises SystemExit; close() errors retrieved, counted and logged once; environment
rewards that are not finite numbers as reward errors naming the environment."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
from collections import Counter

import pytest

from asyncgrpo.config import validate_config
from asyncgrpo.environments.conversation import CharCodec, TokenizerCodec
from asyncgrpo.errors import EpisodeError, RewardError
from asyncgrpo.models.tiny import build_tiny_tokenizer
from asyncgrpo.rewards.scoring import ScoredCompletion
from asyncgrpo.rollout.episode import EnvironmentTimeout, EpisodeRunner, add_env_reward
from asyncgrpo.rollout.in_flight import rollout_request
from asyncgrpo.types import Completion, Episode, GenerationRequest, Prompt, SamplingParams
from tests import envs
from tests.sim.fakes import ProgrammedGenerator, make_collector, recipe
from tests.unit.test_episodes import FAST, env_recipe, first_batches, run_until_steps_then_stop

pytestmark = pytest.mark.timeout(120)
PROMPT = Prompt(0, "question", (1, 2, 3))


@pytest.fixture(autouse=True)
def fresh_envs():
    envs.reset_all()
    yield
    envs.Stubborn.release.set()  # let abandoned threads end


class RecordingCodec(CharCodec):
    """The simulator's codec (one id per character), recording the length of each text it encodes and on which thread."""

    def __init__(self, *, offload: bool) -> None:
        self.offload = offload
        self.lengths: list[int] = []
        self.threads: set[int] = set()

    def encode(self, text: str) -> tuple[int, ...]:
        self.lengths.append(len(text))
        self.threads.add(threading.get_ident())
        return super().encode(text)


async def answer(request: GenerationRequest, floor: int | None) -> Completion:
    return Completion((5, 6, 7), (-1.0,) * 3, (0,) * 3, "stop", 0, text="abc")


def runner(factory: str, codec, **env: object) -> EpisodeRunner:
    cfg = recipe(env={"factory": f"tests.envs:{factory}", "cancel_grace_s": 0.05, "max_turns": 3, "max_tokens": 40, **env})
    return EpisodeRunner(cfg.env, cfg.generation, codec, Counter(), prompt_key="prompt", max_prompt_tokens=64, jitter=random.Random(0))


async def play(episodes: EpisodeRunner) -> Completion:
    request = rollout_request(0, PROMPT, 0, SamplingParams(max_new_tokens=3))
    async with asyncio.timeout(30):
        return await episodes.run(PROMPT, request, answer, on_retry=lambda error: None, between_attempts=asyncio.sleep)


# ---------------------------------------------------------------------------------------------- observation size


def test_an_observation_too_long_for_the_tokens_left_ends_the_episode_without_being_encoded():
    codec = RecordingCodec(offload=False)
    completion = asyncio.run(play(runner("Flooding", codec)))
    episode = completion.episode
    assert episode is not None and episode.stop_reason == "max_tokens" and episode.turns == 1
    assert len(episode.messages[-1]["content"]) == 2_000_000  # kept, as it is, for the reward functions
    assert max(codec.lengths) < 1_000  # never encoded: 37 tokens were left, 1 character each at most
    assert len(completion.token_ids) == 3  # the model's turn only


def test_a_reset_observation_too_long_for_any_prompt_fails_the_rollout_naming_the_limit():
    codec = RecordingCodec(offload=False)
    episodes = runner("FloodingReset", codec)
    with pytest.raises(EpisodeError) as caught:
        asyncio.run(play(episodes))
    message = str(caught.value)
    assert "tests.envs:FloodingReset" in message and "2000000 characters" in message and "data.max_prompt_tokens = 64" in message
    assert max(codec.lengths) < 1_000 and episodes.counters["env/errors_total"] == 1
    assert [e.closed for e in envs.FloodingReset.instances] == [1]


def test_a_codec_that_asks_for_it_encodes_off_the_event_loop():
    codec = RecordingCodec(offload=True)

    async def main() -> tuple[Completion, int]:
        return await play(runner("AsyncEcho", codec, max_tokens=10_000)), threading.get_ident()

    completion, loop_thread = asyncio.run(main())
    assert completion.episode is not None and completion.episode.turns == 3
    assert codec.lengths and loop_thread not in codec.threads


def test_no_token_of_a_tokenizer_decodes_to_more_characters_than_its_codec_says():
    tokenizer = build_tiny_tokenizer()
    codec = TokenizerCodec(tokenizer)
    assert codec.offload
    assert max(len(tokenizer.decode([i])) for i in range(len(tokenizer))) <= codec.max_token_chars


# ---------------------------------------------------------------------------------------------- step deadline


def test_a_step_past_env_step_timeout_is_stopped_and_fails_its_rollout_naming_the_environment_and_step():
    episodes = runner("Stubborn", CharCodec(), step_timeout_s=0.2)
    with pytest.raises(EnvironmentTimeout) as caught:
        asyncio.run(play(episodes))
    message = str(caught.value)
    assert "tests.envs:Stubborn" in message and "step of turn 1" in message and "env.step_timeout_s = 0.2" in message
    assert episodes.counters["env/errors_total"] == 1
    assert episodes.counters["env/abandoned_total"] == 1  # it ignores its token and close(): a thread cannot be killed


def test_the_stall_bound_covers_a_turn_not_every_turn_and_says_where_it_comes_from():
    def cfg(max_turns: int):
        base = recipe(env={"factory": "tests.envs:Cooperative", "max_turns": max_turns}, rollout={"stall_timeout_s": None},
                      reward={"functions": []})
        return validate_config(base.model_dump(mode="json"))

    assert cfg(1000).stall_timeout_s == cfg(1).stall_timeout_s  # an episode's turn is progress (the collector's stall clock)
    bound, source = cfg(4).stall_bound()
    g, env = cfg(4).generation, cfg(4).env
    assert env is not None and bound == g.rollout_deadline_s + 2 * env.step_timeout_s + env.cancel_grace_s + g.health_probe_interval_s + 60
    assert source.startswith("derived: ") and "env.step_timeout_s" in source


# ---------------------------------------------------------------------------------------------- user code that exits


def test_an_environment_raising_system_exit_fails_its_rollout_and_never_ends_the_process():
    cfg = env_recipe("Exits", group_size=2)

    async def main():
        collector = make_collector(cfg, ProgrammedGenerator(lambda request, attempt: FAST))
        async with asyncio.timeout(30), asyncio.TaskGroup() as tasks:
            tasks.create_task(collector.run())
            with pytest.raises(Exception) as caught:  # the failure policy: one all-failed group fails the run
                await collector.next_batch(0, 30.0)
            collector.stop()
        return collector, caught.value

    collector, error = asyncio.run(main())
    assert "generation" in str(error) and "tests.envs:Exits" in str(error) and "SystemExit" in str(error)
    assert collector.counters["env/errors_total"] >= 2 and collector.counters["rollout/failed_total"] >= 2


# ---------------------------------------------------------------------------------------------- close() that raises


def test_close_errors_of_cancelled_episodes_are_retrieved_counted_and_logged_once(caplog):
    caplog.set_level(logging.DEBUG)
    collector = asyncio.run(run_until_steps_then_stop(env_recipe("CloseRaises", group_size=3), 3))
    gc.collect()  # an exception left in a future is reported when the future is collected
    assert [e.closed for e in envs.CloseRaises.instances] == [1, 1, 1]
    assert collector.counters["env/errors_total"] == 3 and collector.counters["env/abandoned_total"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "never retrieved" in m]
    logged = [m for m in messages if "close() raised" in m]
    assert len(logged) == 1 and "tests.envs:CloseRaises" in logged[0] and "close broke" in logged[0]


# ---------------------------------------------------------------------------------------------- rewards that are not finite


def episode_completion(*step_rewards: float) -> Completion:
    total = sum(step_rewards)
    episode = Episode(messages=(), turns=len(step_rewards), stop_reason="done", env_reward=total, version_span=(0, 0),
                      step_rewards=step_rewards)
    return Completion((5,), (-1.0,), (0,), "stop", 0, text="a", episode=episode)


def test_an_environment_reward_that_is_not_finite_is_a_reward_error_naming_the_environment_and_the_steps():
    cfg = recipe(env={"factory": "tests.envs:NanForPromptZero"})
    assert cfg.env is not None
    fine = ScoredCompletion(None, {})
    with pytest.raises(RewardError) as caught:
        add_env_reward([fine, fine], [episode_completion(1.0), episode_completion(0.5, float("nan"))], cfg.env, PROMPT)
    assert "tests.envs:NanForPromptZero" in str(caught.value) and "turn 2: nan" in str(caught.value)
    with pytest.raises(RewardError, match=r"turn 1: 1e\+308, turn 2: 1e\+308\) sum to inf"):
        add_env_reward([fine], [episode_completion(1e308, 1e308)], cfg.env, PROMPT)
    with pytest.raises(RewardError, match="plus the reward functions"):  # finite apart, not together
        add_env_reward([ScoredCompletion(1e308, {"f": 1e308})], [episode_completion(1e308)], cfg.env, PROMPT)


def test_a_nan_environment_reward_drops_its_group_under_reward_on_error_drop():
    cfg = env_recipe("NanForPromptZero", group_size=2)
    cfg = validate_config({**cfg.model_dump(mode="json"), "reward": {"functions": [], "on_error": "drop"}})
    collector, groups = asyncio.run(first_batches(cfg, 2))
    assert 0 not in {g.prompt.id for g in groups}
    assert collector.counters["rollout/dropped/reward_error"] >= 1
    assert all(r.reward == 1.0 for g in groups for r in g.rollouts)
