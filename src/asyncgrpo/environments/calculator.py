"""The built-in calculator environment (`env.factory: asyncgrpo.environments.calculator:CalculatorEnv`).

The rows are `builtin:calculator`'s (tasks.py): a question "what is 37*8?" and its "answer".
In each turn the model either calls the calculator or answers:

- a call is a turn starting with ``calc:`` (after leading blanks) and an expression of
  integers, ``+ - *`` and parentheses: ``calc: 37*8``. Only the expression's leading run of
  those characters is read ("calc: 37*8 ok" computes 37*8). The observation is ``= 296``, or
  ``error: ...`` for an empty or invalid expression. After `max_calls` calls the
  observation asks for the answer instead of computing.
- any other turn is the final answer: the first integer in it is compared with the row's
  answer, and the episode ends.

Rewards (each step's; the episode's is their sum, in [0, 1 + tool_weight]):

- the answer turn: 1.0 when its first integer equals the answer, else 0.0;
- the tool-use term, `tool_weight` x t, earned on the first turn only: t = 1 when the first
  turn is a call whose expression computes; otherwise t = 0.5 x (how many of the first five
  characters of the turn match "calc:" position by position) / 5. The partial credit makes
  the syntax learnable by a model that has never seen it (the built-in tiny one: a random
  policy matches about 1 position in 11), like repeat_letter's per-position credit.

`info` records per step "tool_use" (t, first turn only), "calls" and "correct".

Invariants: the environment never raises on any model text (bad text is the model's mistake
and earns its reward); expressions are evaluated on a parsed tree of integer literals and
+ - * only, at most `MAX_EXPRESSION_CHARS` long, so no text can run code or take long.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from asyncgrpo.tasks import first_integer

CALL_PREFIX = "calc:"
MAX_EXPRESSION_CHARS = 40
_EXPRESSION_RE = re.compile(r"[0-9+\-*() ]*")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses; ValueError for anything else."""
    expression = expression.strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"give an expression of 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers, + - * and parentheses")


def prefix_match(text: str) -> float:
    """The fraction of the first len(CALL_PREFIX) characters of `text` (left-stripped) that match CALL_PREFIX, position by position."""
    head = text.lstrip()[: len(CALL_PREFIX)]
    return sum(1 for got, want in zip(head, CALL_PREFIX) if got == want) / len(CALL_PREFIX)


class CalculatorEnv:
    """One episode: a question from the row, calculator calls, one final answer (see the module docstring)."""

    def __init__(self, tool_weight: float = 0.2, max_calls: int = 3) -> None:
        self.tool_weight = tool_weight
        self.max_calls = max_calls
        self.answer = ""
        self.calls = 0
        self.turns = 0

    def reset(self, row: Mapping[str, Any]) -> None:
        if "answer" not in row:
            raise KeyError(
                "the calculator environment needs an 'answer' column in each row (data.source: builtin:calculator has it); "
                f"this row has {sorted(row)}"
            )
        self.answer = str(row["answer"]).strip()
        self.calls = self.turns = 0
        return None  # the question is the prompt itself

    def step(self, action_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        self.turns += 1
        first = self.turns == 1
        stripped = action_text.lstrip()
        if stripped.startswith(CALL_PREFIX):
            self.calls += 1
            expression = _EXPRESSION_RE.match(stripped[len(CALL_PREFIX) :]).group().strip()  # type: ignore[union-attr]  # * matches
            if self.calls > self.max_calls:
                observation, computed = f"error: no calls left ({self.max_calls} used); give the answer", False
            else:
                try:
                    observation, computed = f"= {evaluate(expression)}", True
                except ValueError as exc:
                    observation, computed = f"error: {exc}", False
            tool_use = (1.0 if computed else 0.5 * prefix_match(action_text)) if first else None
            info: dict[str, Any] = {"calls": self.calls} | ({"tool_use": tool_use} if tool_use is not None else {})
            return observation, self.tool_weight * (tool_use or 0.0), False, info
        correct = first_integer(action_text) == self.answer
        info = {"calls": self.calls, "correct": correct}
        reward = 1.0 if correct else 0.0
        if first:
            info["tool_use"] = 0.5 * prefix_match(action_text)
            reward += self.tool_weight * info["tool_use"]
        return None, reward, True, info

    def close(self) -> None:
        pass
