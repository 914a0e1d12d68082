"""Built-in tasks: rewards by hand, determinism, held-out splits, the charset, and that a random
policy already earns reward on repeat_letter."""

from __future__ import annotations

import random
import statistics

import pytest

from asyncgrpo import tasks
from asyncgrpo.tasks import CHARSET, REPEAT_SPAN, REWARDS, TASKS

pytestmark = pytest.mark.timeout(30)


def test_charset_is_the_tiny_model_vocabulary():
    assert set(CHARSET) == set("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?:.,!'()\n")
    assert len(CHARSET) == len(set(CHARSET)) == 51


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_use_only_the_charset(name):
    task = TASKS[name]
    for row in task.rows(300, 1) + task.eval_rows(300, 1):
        for value in row.values():
            text = "".join(m["content"] for m in value) if isinstance(value, list) else str(value)  # chat rows: the contents
            assert set(text) <= set(CHARSET), row


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_are_deterministic_for_a_seed(name):
    task = TASKS[name]
    assert task.rows(50, 3) == task.rows(50, 3)
    assert task.eval_rows(50, 3) == task.eval_rows(50, 3)
    assert task.rows(50, 3) != task.rows(50, 4)
    assert len(task.rows(7, 0)) == 7 and len(task.eval_rows(5, 0)) == 5
    assert task.rows(0, 0) == []


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_reward_scores_its_own_answers(name):
    task = TASKS[name]
    rows = task.rows(20, 0)
    perfect = [r["letter"] * REPEAT_SPAN if name == "repeat_letter" else r["answer"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    assert task.reward([r["prompt"] for r in rows], perfect, **columns) == [1.0] * len(rows)
    assert REWARDS[name] is task.reward


def test_repeat_letter_rows():
    rows = tasks.repeat_letter_rows(200, 0)
    assert all(r["prompt"] == f"say {r['letter']}: " for r in rows)
    assert {r["letter"] for r in rows} == set(tasks.REPEAT_LETTERS)
    evals = tasks.repeat_letter_eval_rows(10, 0)
    assert sorted(r["letter"] for r in evals) == sorted(tasks.REPEAT_LETTERS * 2)  # balanced


def test_repeat_letter_reward_by_hand():
    reward = tasks.repeat_letter_reward
    p = ["say a: "]
    assert REPEAT_SPAN == 8
    assert reward(p, ["aaaaaaaa"], letter=["a"]) == [1.0]
    assert reward(p, ["aaaaaaaazzzzzz"], letter=["a"]) == [1.0]  # only the first 8 characters count
    assert reward(p, ["aaaa"], letter=["a"]) == [0.5]  # missing positions are misses
    assert reward(p, ["abababab"], letter=["a"]) == [0.5]
    assert reward(p, ["a"], letter=["a"]) == [0.125]
    assert reward(p, ["zzzzzzzza"], letter=["a"]) == [0.0]
    assert reward(p, [""], letter=["a"]) == [0.0]
    assert reward(p, [" aaaaaaa"], letter=["a"]) == [0.875]
    assert reward(p, ["AAAAAAAA"], letter=["a"]) == [0.0]
    # Without a letter column the letter is read from the prompt.
    assert reward(["say c: ", "say d: "], ["cccccccc", "dcdcdcdc"]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="letter"):
        reward(["hello"], ["aaaa"])


def test_random_completions_earn_reward_on_repeat_letter():
    """A uniformly random policy over the charset already scores clearly above 0, and most groups of 8 have variance."""
    rng = random.Random(0)
    rows = tasks.repeat_letter_rows(400, 0)
    group_means, varied = [], 0
    for row in rows:
        completions = ["".join(rng.choice(CHARSET) for _ in range(16)) for _ in range(8)]
        rewards = tasks.repeat_letter_reward([row["prompt"]] * 8, completions, letter=[row["letter"]] * 8)
        assert all(0.0 <= r <= 1.0 for r in rewards)
        group_means.append(statistics.fmean(rewards))
        varied += len(set(rewards)) > 1
    mean = statistics.fmean(group_means)
    assert 0.012 < mean < 0.03  # expectation 1/51 ~ 0.0196
    assert varied / len(rows) > 0.55  # expectation 1 - (50/51)^64 ~ 0.72


def test_addition_rows_and_split():
    rows = tasks.addition_rows(500, 0)
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["answer"] == str(int(a) + int(b))
        assert 0 <= int(a) <= tasks.ADDITION_MAX_OPERAND and 0 <= int(b) <= tasks.ADDITION_MAX_OPERAND
    train_prompts = {r["prompt"] for seed in range(3) for r in tasks.addition_rows(2000, seed)}
    eval_prompts = {r["prompt"] for seed in range(3) for r in tasks.addition_eval_rows(500, seed)}
    assert train_prompts.isdisjoint(eval_prompts)
    assert len(eval_prompts) > 100


def test_addition_reward_by_hand():
    reward = tasks.addition_reward
    p = ["12+7="]
    assert reward(p, ["19"], answer=["19"]) == [1.0]
    assert reward(p, [" 19\n"], answer=["19"]) == [1.0]
    assert reward(p, ["19 because 12+7"], answer=["19"]) == [1.0]
    assert reward(p, ["19\nmore"], answer=["19"]) == [1.0]
    assert reward(p, ["19."], answer=["19"]) == [0.0]
    assert reward(p, ["019"], answer=["19"]) == [0.0]
    assert reward(p, ["the answer is 19"], answer=["19"]) == [0.0]
    assert reward(p, [""], answer=["19"]) == [0.0]
    assert reward(p, ["19"], answer=[19]) == [1.0]  # an integer column from a jsonl file
    assert reward(["12+7=", "1+1="], ["19", "3"]) == [1.0, 0.0]  # answer computed from the prompt
    with pytest.raises(ValueError, match="answer"):
        reward(["what?"], ["1"])


def test_coin_is_deterministic_and_varied():
    prompts, completions = ["p"] * 64, [""] * 64
    first = tasks.coin_reward(prompts, completions)
    assert first == tasks.coin_reward(prompts, completions)
    assert set(first) == {0.0, 1.0}
    assert 16 < sum(first) < 48
    by_sample = tasks.coin_reward(prompts[:8], completions[:8], sample=list(range(100, 108)))
    assert by_sample == tasks.coin_reward(prompts[:8], completions[:8], sample=list(range(100, 108)))
    # Different prompts give different patterns.
    patterns = {tuple(tasks.coin_reward([f"p{i}"] * 8, [""] * 8)) for i in range(20)}
    assert len(patterns) > 10
    assert "coin" in REWARDS and "coin" not in TASKS
