"""Judging a finished group (rollout/judge.py): survivors, drop reasons, reward filtering and advantages."""

from __future__ import annotations

import pytest

from asyncgrpo.errors import GenerationError, PromptRejectedError
from asyncgrpo.rewards.scoring import ScoredCompletion, UnscoredGroupError
from asyncgrpo.rollout.judge import scored_rollouts, survivors
from asyncgrpo.types import Completion, Drop, Prompt

PROMPT = Prompt(id=3, text="say a", token_ids=(1, 2))


def completion(text: str) -> Completion:
    return Completion(token_ids=(5,), logprobs=(-0.1,), versions=(0,), finish_reason="stop", dispatch_version=0, text=text)


def scored(*rewards: float | None) -> list[ScoredCompletion]:
    return [ScoredCompletion(reward=r, terms={"f": r}) for r in rewards]


def judge(rewards: tuple[float | None, ...], *, min_survivors: int = 2, filter_zero_variance: bool = True, scale_by_std: bool = False):
    completions = [completion(str(i)) for i in range(len(rewards))]
    return scored_rollouts(PROMPT, completions, scored(*rewards), min_survivors=min_survivors,
                           filter_zero_variance=filter_zero_variance, scale_by_std=scale_by_std)


def test_survivors_are_the_finished_members_in_member_order():
    a, b = completion("a"), completion("b")
    error = GenerationError("boom")
    assert survivors([a, None, b], [None, error, None], min_survivors=2) == [a, b]


def test_a_group_whose_every_prompt_was_rejected_is_an_invalid_prompt():
    first, second = PromptRejectedError("too long"), PromptRejectedError("too long again")
    assert survivors([None, None], [first, second], min_survivors=2) == Drop("invalid_prompt", first)


def test_a_group_with_no_survivor_failed_and_names_a_failure_that_is_not_a_rejection():
    rejected, failed = PromptRejectedError("too long"), GenerationError("boom")
    assert survivors([None, None], [rejected, failed], min_survivors=2) == Drop("failed", failed)


def test_too_few_survivors_carry_the_first_error():
    error = GenerationError("boom")
    assert survivors([completion("a"), None, None], [None, error, GenerationError("x")], min_survivors=2) == Drop("too_few_survivors", error)


def test_too_few_survivors_without_a_failure_carry_no_error():
    # (every member ended, none failed, the group is smaller than min_survivors: what a partial group's kept members can be)
    assert survivors([completion("a")], [None], min_survivors=2) == Drop("too_few_survivors", None)


def test_every_member_needs_a_completion_or_an_error():
    with pytest.raises(AssertionError, match="1 survivors \\+ 0 errors != 2"):
        survivors([completion("a"), None], [None, None], min_survivors=1)


def test_scored_rollouts_keep_the_rewarded_with_centred_advantages():
    rollouts = judge((1.0, None, 0.0))
    assert not isinstance(rollouts, Drop)
    assert [r.completion.text for r in rollouts] == ["0", "2"]
    assert [r.reward for r in rollouts] == [1.0, 0.0]
    assert [r.advantage for r in rollouts] == pytest.approx([0.5, -0.5])
    assert [dict(r.reward_terms) for r in rollouts] == [{"f": 1.0}, {"f": 0.0}]


def test_too_few_rewarded_completions_drop_the_group_naming_the_function():
    drop = judge((1.0, None, None))
    assert isinstance(drop, Drop) and drop.reason == "too_few_survivors"
    assert isinstance(drop.error, UnscoredGroupError) and "'f' returned None for 2 of 3 completions" in str(drop.error)
    assert "fewer than rollout.min_group_survivors = 2" in str(drop.error)


def test_advantages_are_scaled_by_the_group_std_when_asked():
    scaled = judge((1.0, 0.0, 0.0, 0.0), scale_by_std=True)
    assert not isinstance(scaled, Drop)
    assert [r.advantage for r in scaled] == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-4)  # centred, over the sample std 0.5


def test_equal_rewards_are_filtered_only_when_asked():
    assert judge((0.5, 0.5)) == Drop("filtered", None)
    kept = judge((0.5, 0.5), filter_zero_variance=False)
    assert not isinstance(kept, Drop) and [r.advantage for r in kept] == [0.0, 0.0]
