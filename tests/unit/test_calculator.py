"""The built-in calculator environment: calls compute, the final answer is checked, and the tool-use term gives
partial credit for the call syntax so a model that has never seen it can learn it."""

from __future__ import annotations

import pytest

from asyncgrpo.environments.calculator import CalculatorEnv, evaluate, prefix_match
from asyncgrpo.tasks import TASKS


def episode(*turns, answer="296", **kwargs):
    env = CalculatorEnv(**kwargs)
    assert env.reset({"prompt": [], "answer": answer}) is None
    steps = [env.step(turn) for turn in turns]
    env.close()
    return steps


def test_expressions_of_integers_and_plus_minus_times_compute():
    assert evaluate("37*8") == 296 and evaluate(" (2+3) * 4 ") == 20 and evaluate("-3+1") == -2


@pytest.mark.parametrize("expression", ["", "2**3", "7/2", "1e3", "(1", "x", "9" * 41])
def test_anything_else_is_a_value_error(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_a_call_then_the_right_answer_earns_the_tool_term_and_the_answer():
    (call, answer) = episode("calc: 37*8 then", "296")
    assert call == ("= 296", pytest.approx(0.2), False, {"calls": 1, "tool_use": 1.0})
    assert answer == (None, 1.0, True, {"calls": 1, "correct": True})


def test_a_wrong_answer_scores_nothing_for_itself():
    (call, answer) = episode("calc: 37*8", "it is 295")
    assert answer[1] == 0.0 and answer[2] and answer[3]["correct"] is False


def test_an_answer_without_a_call_gets_partial_tool_credit_only_for_the_syntax():
    ((_, reward, done, info),) = episode("296")
    assert done and info["correct"] and info["tool_use"] == 0.0 and reward == 1.0
    ((_, reward, done, info),) = episode("cax 1")  # "c" and "a" match "calc:" in place
    assert info["tool_use"] == pytest.approx(0.5 * prefix_match("cax 1")) == pytest.approx(0.5 * 2 / 5)
    assert reward == pytest.approx(0.2 * info["tool_use"]) and done


def test_a_call_that_does_not_compute_is_shown_the_error_and_earns_half_the_tool_term():
    ((observation, reward, done, info),) = episode("calc: )(")
    assert observation.startswith("error: ") and not done
    assert info["tool_use"] == 0.5 and reward == pytest.approx(0.1)


def test_calls_past_the_limit_are_refused_and_only_the_first_turn_earns_the_tool_term():
    steps = episode("calc: 1", "calc: 2", "calc: 3", max_calls=2)
    assert [s[0] for s in steps] == ["= 1", "= 2", "error: no calls left (2 used); give the answer"]
    assert [s[1] for s in steps] == [pytest.approx(0.2), 0.0, 0.0] and "tool_use" not in steps[1][3]


def test_the_calculator_task_rows_carry_the_answer_the_environment_checks():
    rows = TASKS["calculator"].rows(50, 0)
    for row in rows:
        question = row["prompt"][0]["content"]
        expression = question.removeprefix("what is ").removesuffix("?")
        assert evaluate(expression) == int(row["answer"])
        ((_, reward, done, info),) = episode(row["answer"], answer=row["answer"])
        assert info["correct"] and done
    held_out = {r["prompt"][0]["content"] for r in TASKS["calculator"].eval_rows(200, 0)}
    assert held_out.isdisjoint(r["prompt"][0]["content"] for r in TASKS["calculator"].rows(2000, 1))
