"""TRL-shaped reward arguments: conversational prompts give reward functions message lists, as TRL's
GRPOTrainer does; text prompts keep strings (the same in worker processes: tests/component/test_trl_reward_isolation.py)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from asyncgrpo.data.loading import build_prompts
from asyncgrpo.models.tiny import build_tiny_tokenizer
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.rollout.no_signal import NoSignalWatch
from asyncgrpo.tasks import arithmetic_correct_reward, arithmetic_format_reward, digit_arithmetic_eval_rows, digit_arithmetic_rows
from asyncgrpo.types import Completion

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "what is 3 * 4? answer with only the number."}]


def prompts_of(rows):
    prompts, _ = build_prompts(rows, prompt_key="prompt", tokenizer=build_tiny_tokenizer(), max_prompt_tokens=256)
    return prompts


def echo_module(tmp_path):
    (tmp_path / "shape_rewards.py").write_text(textwrap.dedent('''
        def trl_style(prompts, completions, answer, **kwargs):
            """TRL's access pattern for conversational data (e.g. trl.rewards.accuracy_reward)."""
            assert prompts[0][-1]["role"] == "user", prompts
            return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

        def text_style(prompts, completions, **kwargs):
            assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
            return [float(len(c)) for c in completions]
    '''))
    return str(tmp_path / "shape_rewards.py")


def test_trl_reward_functions_work_unchanged():
    pytest.importorskip("trl.rewards", reason="trl is not installed in this environment")
    chat = prompts_of([{"prompt": MESSAGES}])[0]

    async def score():
        from asyncgrpo.rewards.resolve import resolve_rewards

        specs = ["trl.rewards:think_format_reward"]
        async with RewardScorer(resolve_rewards(specs), isolation="thread", specs=specs) as scorer:
            return await scorer.score(chat, ["<think>\nthree fours\n</think>\n12", "12"])

    assert [s.reward for s in asyncio.run(score())] == [1.0, 0.0]


def completion(text: str, length: int) -> Completion:
    return Completion(tuple(range(length)), (0.0,) * length, (0,) * length, "stop", 0, text=text)


def test_trls_length_rewards_score_the_generated_tokens():
    rewards = pytest.importorskip("trl.rewards", reason="trl is not installed in this environment")
    overlong = rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)  # DAPO's: -1 at 10 tokens
    chat = prompts_of([{"prompt": MESSAGES}])[0]

    async def score():
        async with RewardScorer([("overlong", overlong)]) as scorer:
            return await scorer.score(chat, [completion("12", 5), completion("twelve is the answer", 8), completion("...", 10)])

    assert [s.reward for s in asyncio.run(score())] == pytest.approx([0.0, -0.5, -1.0])


def test_digit_arithmetic_is_conversational_held_out_and_scored_on_either_shape():
    train, held_out = digit_arithmetic_rows(200, 0), digit_arithmetic_eval_rows(50, 0)
    assert all(isinstance(r["prompt"], list) for r in train)
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held_out}
    assert len({r["prompt"][0]["content"] for r in digit_arithmetic_eval_rows(48, 0)}) == 48  # every held-out item, once
    completions = ["12", [{"role": "assistant", "content": "12."}], "it is 12", "13", "3 * 4 = 12", "12 - 7 is 5", "3*4 is 12.0"]
    assert arithmetic_correct_reward(None, completions, ["12"] * 7, ["3 * 4"] * 7) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert arithmetic_format_reward(None, completions) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    echoes = ["4 * 0", "To solve 4*0", "what is 4 * 0? answer with only the number.", "4 * 0 = 0"]  # the answer is 0
    assert arithmetic_correct_reward(None, echoes, ["0"] * 4, ["4 * 0"] * 4) == [0.0, 0.0, 0.0, 1.0]  # an echo is no answer
    assert all(set(row) == {"prompt", "expression", "answer"} for row in train)


def test_no_signal_warning_fires_once_when_most_of_a_full_window_had_equal_rewards():
    watch = NoSignalWatch(window=4)
    assert [watch.observe(flat) for flat in (True, True, True)] == [None] * 3  # window not full yet
    warning = watch.observe(False)  # 3 of 4 flat
    assert warning is not None and "3 of the last 4 groups" in warning and "rollout.filter_zero_variance: true" in warning
    assert all(watch.observe(True) is None for _ in range(8))  # once


def test_no_signal_warning_stays_quiet_at_half_or_less():
    watch = NoSignalWatch(window=4)
    assert all(watch.observe(flat) is None for flat in [True, False] * 10)
