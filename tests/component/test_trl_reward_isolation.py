"""TRL-shaped reward arguments in every isolation mode, worker processes included: conversational prompts give reward
functions message lists and text prompts strings, and `completion_ids` reach the functions that ask for them (the
shapes themselves: tests/unit/test_trl_rewards.py)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rewards.scoring import RewardScorer
from tests.unit.test_trl_rewards import MESSAGES, completion, echo_module, prompts_of

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_conversational_prompts_pass_message_lists_and_text_prompts_pass_strings(tmp_path, isolation):
    module = echo_module(tmp_path)
    chat = prompts_of([{"prompt": MESSAGES, "answer": "12"}])[0]
    text = prompts_of([{"prompt": "say a: "}])[0]
    assert chat.messages == tuple(MESSAGES)

    async def score():
        specs = [f"{module}:trl_style"]
        from asyncgrpo.rewards.resolve import resolve_rewards

        async with RewardScorer(resolve_rewards(specs), isolation=isolation, specs=specs, workers=1) as scorer:
            chat_scores = await scorer.score(chat, ["12", " 13"])
        specs = [f"{module}:text_style"]
        async with RewardScorer(resolve_rewards(specs), isolation=isolation, specs=specs, workers=1) as scorer:
            text_scores = await scorer.score(text, ["aa", "aaaa"])
        return chat_scores, text_scores

    chat_scores, text_scores = asyncio.run(score())
    assert [s.reward for s in chat_scores] == [1.0, 0.0]
    assert [s.reward for s in text_scores] == [2.0, 4.0]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_completion_ids_reach_the_functions_that_ask_for_them_as_trl_passes_them(tmp_path, isolation):
    (tmp_path / "id_rewards.py").write_text(textwrap.dedent('''
        def token_count(prompts, completions, completion_ids):
            return [float(len(ids)) for ids in completion_ids]

        def no_ids(prompts, completions):
            return [1.0 for _ in completions]
    '''))
    specs = [f"{tmp_path / 'id_rewards.py'}:token_count", f"{tmp_path / 'id_rewards.py'}:no_ids"]
    chat = prompts_of([{"prompt": MESSAGES}])[0]

    async def score():
        async with RewardScorer(resolve_rewards(specs), isolation=isolation, specs=specs, workers=1) as scorer:
            return await scorer.score(chat, [completion("12", 2), completion("twelve", 5)])

    assert [s.terms for s in asyncio.run(score())] == [{"token_count": 2.0, "no_ids": 1.0}, {"token_count": 5.0, "no_ids": 1.0}]
