"""The built-in calculator environment: calls compute (the question's own expression when none is given), the final
answer is checked, and a call in the first turn earns the tool-use term."""

from __future__ import annotations

import pytest

from asyncgrpo.environments.calculator import CalculatorEnv, evaluate
from asyncgrpo.tasks import TASKS


def episode(*turns, answer="296", expression="37*8", **kwargs):
    env = CalculatorEnv(**kwargs)
    assert env.reset({"prompt": [], "expression": expression, "answer": answer}) is None
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
    (call, answer) = episode("= 37*8 then", "296")
    assert call == ("= 296", pytest.approx(0.2), False, {"calls": 1, "tool_use": 1.0})
    assert answer == (None, 1.0, True, {"calls": 1, "correct": True})


def test_a_bare_call_computes_the_questions_expression():
    (call, answer) = episode("====", "it is 295", expression="37*8")
    assert call[0] == "= 296" and call[1] == pytest.approx(0.2) and call[3]["tool_use"] == 1.0
    assert answer[1] == 0.0 and answer[2] and answer[3]["correct"] is False  # a wrong answer scores nothing for itself


def test_an_answer_without_a_call_earns_no_tool_term():
    ((observation, reward, done, info),) = episode(" 296 ")
    assert (observation, reward, done, info) == (None, 1.0, True, {"calls": 0, "correct": True, "tool_use": 0.0})


@pytest.mark.parametrize(("turn", "expression", "answer", "correct"), [
    ("37 * 8 = 296", "37*8", "296", True), ("296 (from = 37*8)", "37*8", "296", True), ("296, not 295", "37*8", "296", False),
    ("18 - 9", "18-9", "9", False), ("so 18-9", "18-9", "9", False), ("18 - 9 = 9", "18-9", "9", True),  # an echo ends on 9 too
])
def test_the_answer_is_the_number_a_turn_ends_on_not_an_echo_of_the_question(turn, expression, answer, correct):
    ((_, reward, done, info),) = episode(turn, expression=expression, answer=answer)
    assert done and info["correct"] is correct and reward == (1.0 if correct else 0.0)


def test_a_call_that_does_not_compute_is_shown_the_error_and_earns_nothing():
    ((observation, reward, done, info),) = episode("= 3)(")
    assert observation.startswith("error: ") and not done and reward == 0.0 and info["tool_use"] == 0.0
    ((observation, _, _, _),) = episode("=", expression="")  # a row without an expression: = needs one
    assert observation.startswith("error: give an expression")


def test_calls_past_the_limit_are_refused_and_only_the_first_turn_earns_the_tool_term():
    steps = episode("= 1", "= 2", "= 3", max_calls=2)
    assert [s[0] for s in steps] == ["= 1", "= 2", "error: no calls left (2 used); give the answer"]
    assert [s[1] for s in steps] == [pytest.approx(0.2), 0.0, 0.0] and "tool_use" not in steps[1][3]


def test_the_calculator_task_rows_carry_the_answer_the_environment_checks():
    rows = TASKS["calculator"].rows(50, 0)
    for row in rows:
        question = row["prompt"][0]["content"]
        assert question == f"what is {row['expression']}?" and evaluate(row["expression"]) == int(row["answer"])
        ((_, reward, done, info),) = episode(row["answer"], answer=row["answer"])
        assert info["correct"] and done
    held_out = {r["prompt"][0]["content"] for r in TASKS["calculator"].eval_rows(200, 0)}
    assert held_out.isdisjoint(r["prompt"][0]["content"] for r in TASKS["calculator"].rows(2000, 1))
