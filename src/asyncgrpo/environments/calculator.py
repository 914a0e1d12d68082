"""The built-in calculator environment (`env.factory: asyncgrpo.environments.calculator:CalculatorEnv`).

The rows are `builtin:calculator`'s (tasks.py): a question "what is 37*8?", its "expression"
("37*8") and its "answer". In each turn the model either calls the calculator or answers:

- a call is a turn starting with ``=`` (after leading blanks), like a calculator's key,
  optionally followed by an expression of integers, ``+ - *`` and parentheses: ``= 37*8``. Only
  the expression's leading run of those characters is read ("=37*8 ok" computes 37*8); ``=``
  alone computes the question's own expression. The observation is ``= 296``, or
  ``error: ...`` for an invalid expression; after `max_calls` calls it asks for the answer.
- any other turn is the final answer: the number it answers with (the last one, restatements of
  the question's expression left out) is compared with the row's answer, and the episode ends.

Rewards (each step's; the episode's is their sum, in [0, 1 + tool_weight]):

- the answer turn: 1.0 when the number it answers with equals the answer, else 0.0;
- the tool-use term: `tool_weight` when the first turn is a call that computes, else 0.

Why this syntax: a model that has never seen it must find it by sampling. ``=`` is one
character, which a random policy of the built-in tiny model starts a turn with about once in
55 samples: a step of 64 episodes sees a few, and GRPO takes it from there, as it learns
repeat_letter. A multi-character keyword (``calc:`` was tried, with partial credit per matching
character) is not learnt: the tiny model learns to repeat the first character everywhere
("cccc..."), its entropy collapses, and the next character is never sampled again.

`info` records per step "calls", "tool_use" (first turn: 1.0 or 0.0) and, at the answer, "correct".

Invariants: the environment never raises on any model text (bad text is the model's mistake
and earns its reward); expressions are evaluated on a parsed tree of integer literals and
+ - * only, at most `MAX_EXPRESSION_CHARS` long, so no text can run code or take long.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from asyncgrpo.tasks import answer_number

CALL_PREFIX = "="
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


class CalculatorEnv:
    """One episode: a question from the row, calculator calls, one final answer (see the module docstring)."""

    def __init__(self, tool_weight: float = 0.2, max_calls: int = 3) -> None:
        self.tool_weight = tool_weight
        self.max_calls = max_calls
        self.answer = ""
        self.expression = ""
        self.calls = 0
        self.turns = 0

    def reset(self, row: Mapping[str, Any]) -> None:
        if "answer" not in row:
            raise KeyError(
                "the calculator environment needs an 'answer' column in each row (data.source: builtin:calculator has it); "
                f"this row has {sorted(row)}"
            )
        self.answer = str(row["answer"]).strip()
        self.expression = str(row.get("expression") or "")
        self.calls = self.turns = 0
        return None  # the question is the prompt itself

    def step(self, action_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        self.turns += 1
        first = self.turns == 1
        stripped = action_text.lstrip()
        if not stripped.startswith(CALL_PREFIX):
            correct = answer_number(action_text, self.expression) == self.answer
            info: dict[str, Any] = {"calls": self.calls, "correct": correct} | ({"tool_use": 0.0} if first else {})
            return None, 1.0 if correct else 0.0, True, info
        self.calls += 1
        expression = _EXPRESSION_RE.match(stripped[len(CALL_PREFIX) :]).group().strip() or self.expression  # type: ignore[union-attr]
        computed = False
        if self.calls > self.max_calls:
            observation = f"error: no calls left ({self.max_calls} used); give the answer"
        else:
            try:
                observation, computed = f"= {evaluate(expression)}", True
            except ValueError as exc:
                observation = f"error: {exc}"
        info = {"calls": self.calls} | ({"tool_use": 1.0 if computed else 0.0} if first else {})
        return observation, self.tool_weight if first and computed else 0.0, False, info

    def close(self) -> None:
        pass
