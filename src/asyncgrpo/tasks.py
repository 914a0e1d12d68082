"""Built-in tasks with verifiable rewards.

A built-in task is referenced as `data.source: builtin:<name>` (its prompts) and
`reward.functions: [builtin:<name>]` (its reward). Every task offers

- `rows(n, seed) -> list[dict]`: training rows, a "prompt" column plus the columns its
  reward reads ("letter", "answer"), deterministic for a seed;
- `eval_rows(n, seed) -> list[dict]`: held-out rows, disjoint from every training row where
  the task's prompt space allows it, otherwise drawn from a separate seed stream;
- `reward(prompts, completions, **columns) -> list[float]`, TRL's convention: every column
  is a list aligned with `completions`; prompts and completions are strings, or message lists
  for conversational prompts (`content_text` reads either).

Invariants:
- Every prompt and answer uses only `CHARSET` (the vocabulary of the built-in tiny
  char-level model): lowercase a-z, digits, space, ``+-*/=?:.,!'()`` and newline.
- Rewards lie in [0, 1], never raise on any completion text, and are pure functions of
  their inputs (no global random state), so scoring is reproducible.
- `rows` and `eval_rows` never consult global random state: the same (n, seed) gives the
  same rows in every process.

`coin` is a reward only: a simulator aid with no data of its own.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?:.,!'()\n"
"""Characters every built-in prompt and answer is made of (51 characters)."""

RowsFn = Callable[[int, int], list[dict[str, Any]]]
RewardFn = Callable[..., list[float]]


def content_text(value: Any) -> str:
    """The text of a prompt or completion as a reward receives it: a string as it is, or (conversational
    prompts, TRL's shape: rewards/scoring.py) the content of the last message of a message list."""
    if isinstance(value, str):
        return value
    return str(value[-1]["content"]) if value else ""


# ---------------------------------------------------------------------------------------
# repeat_letter: the demo task

REPEAT_LETTERS = "abcde"
"""Letters a repeat_letter prompt asks for."""

REPEAT_SPAN = 8
"""How many leading completion characters the repeat_letter reward inspects (N)."""

_SAY_RE = re.compile(r"say ([a-z]): ")


def repeat_letter_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows ``{"prompt": "say x: ", "letter": "x"}``, x drawn uniformly from `REPEAT_LETTERS`."""
    rng = random.Random(f"asyncgrpo:repeat_letter:train:{seed}")
    return [_repeat_row(rng.choice(REPEAT_LETTERS)) for _ in range(n)]


def repeat_letter_eval_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Held-out rows. The task has only len(REPEAT_LETTERS) distinct prompts, so eval rows
    cannot be disjoint from training rows; they come from a separate seed stream and cycle
    through the letters so that every letter is evaluated equally often."""
    rng = random.Random(f"asyncgrpo:repeat_letter:eval:{seed}")
    letters = list(REPEAT_LETTERS)
    rng.shuffle(letters)
    return [_repeat_row(letters[i % len(letters)]) for i in range(n)]


def _repeat_row(letter: str) -> dict[str, Any]:
    return {"prompt": f"say {letter}: ", "letter": letter}


def repeat_letter_reward(
    prompts: Sequence[str], completions: Sequence[str], letter: Sequence[str] | None = None, **_: Any
) -> list[float]:
    """Reward of the `repeat_letter` task: how well the completion repeats the asked letter.

    Definition: with x the row's "letter" (or, when no such column is given, the letter in
    the prompt's ``say x: ``), and c the completion text,

        reward = #{ i < N : c[i] == x } / N,      N = REPEAT_SPAN = 8

    i.e. the fraction of the first 8 completion characters that equal x. Characters past the
    8th are ignored; a completion shorter than 8 characters (it sampled EOS early) scores its
    missing positions as misses. Values are multiples of 1/8 in [0, 1]; "xxxxxxxx..." scores 1.

    Why it is learnable by GRPO from a random char-level model: a near-uniform policy over
    the tiny model's 55 tokens already hits x with probability ~1/55 per position, so a
    completion scores > 0 with probability ~14% and a group of 8 has reward variance ~70%
    of the time from step one (mean reward ~0.02). The credit is dense (per position,
    partial), so the advantage pushes up log p(x | prompt) at every hit, and with only
    len(REPEAT_LETTERS) = 5 letters the model needs to learn just 5 prompt -> letter
    mappings. Learning shows in two stages: emitting letters of the small set (~0.2 without
    reading the prompt), then copying the asked letter (towards 1.0).
    """
    if letter is None:
        letter = [_letter_from_prompt(content_text(p)) for p in prompts]
    if len(letter) != len(completions):
        raise ValueError(f"repeat_letter: {len(letter)} 'letter' values for {len(completions)} completions")
    rewards = []
    for want, text in zip(letter, completions):
        want = str(want)
        if len(want) != 1:
            raise ValueError(f"repeat_letter: the 'letter' column must hold one character, got {want!r}")
        hits = sum(1 for ch in content_text(text)[:REPEAT_SPAN] if ch == want)
        rewards.append(hits / REPEAT_SPAN)
    return rewards


def _letter_from_prompt(prompt: str) -> str:
    match = _SAY_RE.search(prompt)
    if match is None:
        raise ValueError(
            f"repeat_letter: no 'letter' column and the prompt {prompt[:80]!r} does not contain 'say x: '; "
            "give the rows a 'letter' column"
        )
    return match.group(1)


# ---------------------------------------------------------------------------------------
# addition

ADDITION_MAX_OPERAND = 99
"""Operands are integers in [0, ADDITION_MAX_OPERAND]."""

_ADDITION_EVAL_MODULUS = 10
"""One operand pair in ten (by a fixed hash) is held out for evaluation."""


def _addition_is_eval(a: int, b: int) -> bool:
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _ADDITION_EVAL_MODULUS == 0


def _addition_pairs(held_out: bool) -> list[tuple[int, int]]:
    span = range(ADDITION_MAX_OPERAND + 1)
    return [(a, b) for a in span for b in span if _addition_is_eval(a, b) == held_out]


def addition_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows ``{"prompt": "12+7=", "answer": "19"}`` over operand pairs in [0, 99]^2, never
    a held-out pair (a fixed ~10% of pairs, chosen by hash, is reserved for `eval_rows`)."""
    return _addition_sample(_addition_pairs(held_out=False), n, f"asyncgrpo:addition:train:{seed}")


def addition_eval_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` held-out rows: operand pairs disjoint from every training row of every seed."""
    return _addition_sample(_addition_pairs(held_out=True), n, f"asyncgrpo:addition:eval:{seed}")


def _addition_sample(pairs: list[tuple[int, int]], n: int, stream: str) -> list[dict[str, Any]]:
    rng = random.Random(stream)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in (rng.choice(pairs) for _ in range(n))]


def addition_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """Reward of the `addition` task: 1.0 for the exact sum, else 0.0 (no format credit).

    Definition: the completion is stripped of leading whitespace and cut at its first space
    or newline; the reward is 1.0 when what remains equals ``str(answer).strip()`` exactly
    ("19" for "12+7="), else 0.0. So "19", " 19\\n" and "19 because..." score 1; "019",
    "19." and "the answer is 19" score 0. When no "answer" column is given, the answer is
    computed from an ``a+b=`` prompt.
    """
    if answer is None:
        answer = [_answer_from_prompt(content_text(p)) for p in prompts]
    if len(answer) != len(completions):
        raise ValueError(f"addition: {len(answer)} 'answer' values for {len(completions)} completions")
    return [1.0 if _first_word(content_text(text)) == str(want).strip() else 0.0 for want, text in zip(answer, completions)]


_ADDITION_RE = re.compile(r"(\d+)\+(\d+)=\s*$")


def _answer_from_prompt(prompt: str) -> str:
    match = _ADDITION_RE.search(prompt)
    if match is None:
        raise ValueError(
            f"addition: no 'answer' column and the prompt {prompt[-80:]!r} does not end in 'a+b='; "
            "give the rows an 'answer' column"
        )
    return str(int(match.group(1)) + int(match.group(2)))


def _first_word(text: str) -> str:
    text = text.lstrip()
    cut = len(text)
    for sep in (" ", "\n"):
        pos = text.find(sep)
        if pos != -1:
            cut = min(cut, pos)
    return text[:cut]


# ---------------------------------------------------------------------------------------
# digit_arithmetic: conversational, for small instruct models (builtin:smollm2-135m-instruct)

_ARITHMETIC_OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER_RE = re.compile(r"-?\d+")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def _arithmetic_items(held_out: bool) -> list[tuple[int, str, int]]:
    """(a, op, b) over single digits, b <= a for '-' (no negative answers); one in five held out by hash."""
    items = [(a, op, b) for op in _ARITHMETIC_OPS for a in range(10) for b in range(10) if op != "-" or b <= a]
    return [i for i in items if (int.from_bytes(hashlib.blake2b(repr(i).encode(), digest_size=8).digest(), "little") % 5 == 0) == held_out]


def _arithmetic_sample(held_out: bool, n: int, stream: str) -> list[dict[str, Any]]:
    """`n` rows going through the items in shuffled rounds: every item once before any twice."""
    rng = random.Random(stream)
    items = _arithmetic_items(held_out)
    rounds = [rng.sample(items, len(items)) for _ in range(-(-n // len(items)))]
    rows = []
    for a, op, b in [item for round_ in rounds for item in round_][:n]:
        question = f"what is {a} {op} {b}? answer with only the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "expression": f"{a} {op} {b}",
                     "answer": str(_ARITHMETIC_OPS[op](a, b))})
    return rows


def digit_arithmetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` chat rows ``{"prompt": [{"role": "user", "content": "what is 3 * 4? answer with only the number."}],
    "expression": "3 * 4", "answer": "12"}``: single digits, +, - (never negative) and *, never a held-out item."""
    return _arithmetic_sample(False, n, f"asyncgrpo:digit_arithmetic:train:{seed}")


def digit_arithmetic_eval_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` held-out rows: items (a fixed fifth, by hash) disjoint from every training row of every seed."""
    return _arithmetic_sample(True, n, f"asyncgrpo:digit_arithmetic:eval:{seed}")


def answer_number(text: str, expression: str = "") -> str | None:
    """The number `text` answers with: the last one once every restatement of `expression` (the question's, spacing
    free) is taken out, so "7 + 5 = 12" and "7+5 is 12." answer "12" and "7 + 5" (cut off, or echoed) answers None;
    "12.0" reads as "12". None when no number is left."""
    if expression:
        tokens = re.findall(r"\d+|\S", expression)
        text = re.sub(r"(?<!\d)" + r"\s*".join(map(re.escape, tokens)) + r"(?!\d)", " ", text)
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    whole, _, fraction = found[-1].partition(".")
    return whole if not fraction.strip("0") else found[-1]


def arithmetic_correct_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], expression: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """1.0 when the number the completion answers with (`answer_number`, given the row's "expression") equals the row's
    "answer", else 0.0: "12" and "3 * 4 = 12." score 1, an echoed "3 * 4" scores 0 (the first integer would score a
    restated question as its answer, the last integer an echo of it)."""
    expressions = expression if expression is not None else [""] * len(completions)
    return [
        1.0 if answer_number(content_text(completion), str(question)) == str(want).strip() else 0.0
        for want, completion, question in zip(answer, completions, expressions)
    ]


def arithmetic_format_reward(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 when the completion is only an integer, optionally ending in a full stop ("12", " 12.\\n"), else 0.0."""
    return [1.0 if _INTEGER_RE.fullmatch(content_text(c).strip().removesuffix(".")) else 0.0 for c in completions]


# ---------------------------------------------------------------------------------------
# calculator: questions for the calculator tool environment (environments/calculator.py)

_CALCULATOR_OPS = ("+", "-", "*")


def _calculator_items(held_out: bool) -> list[tuple[int, str, int]]:
    """(a, op, b) with a in [10, 99], b in [2, 9] (so a - b > 0); one in ten held out by hash."""
    items = [(a, op, b) for op in _CALCULATOR_OPS for a in range(10, 100) for b in range(2, 10)]
    return [i for i in items if (int.from_bytes(hashlib.blake2b(repr(i).encode(), digest_size=8).digest(), "little") % 10 == 0) == held_out]


def _calculator_sample(held_out: bool, n: int, stream: str) -> list[dict[str, Any]]:
    rng = random.Random(stream)
    items = _calculator_items(held_out)
    rows = []
    for a, op, b in (rng.choice(items) for _ in range(n)):
        expression = f"{a}{op}{b}"
        rows.append({"prompt": [{"role": "user", "content": f"what is {expression}?"}], "expression": expression,
                     "answer": str(_ARITHMETIC_OPS[op](a, b))})
    return rows


def calculator_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` chat rows ``{"prompt": [{"role": "user", "content": "what is 37*8?"}], "expression": "37*8", "answer": "296"}``
    (two digits with one digit; +, -, *), never a held-out item. The calculator environment scores the episodes."""
    return _calculator_sample(False, n, f"asyncgrpo:calculator:train:{seed}")


def calculator_eval_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` held-out rows: items (a fixed tenth, by hash) disjoint from every training row of every seed."""
    return _calculator_sample(True, n, f"asyncgrpo:calculator:eval:{seed}")


# ---------------------------------------------------------------------------------------
# coin: simulator aid


def coin_reward(
    prompts: Sequence[str], completions: Sequence[str], sample: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """A simulator aid, not a task: a deterministic pseudo-random 0/1 reward.

    Definition: for completion i, with s = ``sample[i]`` when a "sample" column is given, else
    the index i within the call,

        reward = lowest bit of blake2b(prompt_i, completion_i, s)

    so it is 0 or 1 with probability 1/2 each, independent across completions and stable
    across processes. Scripted completions that all have the same (or empty) text still get
    varied rewards within a group. It reads no meaning from the text; never train a real
    model on it.
    """
    if sample is not None and len(sample) != len(completions):
        raise ValueError(f"coin: {len(sample)} 'sample' values for {len(completions)} completions")
    rewards = []
    for i, (prompt, text) in enumerate(zip(prompts, completions)):
        salt = sample[i] if sample is not None else i
        digest = hashlib.blake2b(
            "\x1f".join((str(prompt), str(text), str(salt))).encode(), digest_size=8
        ).digest()
        rewards.append(float(digest[0] & 1))
    return rewards


# ---------------------------------------------------------------------------------------
# Registries


@dataclass(frozen=True)
class Task:
    """A built-in data source with its reward function."""

    name: str
    description: str
    rows: RowsFn
    eval_rows: RowsFn
    reward: RewardFn


TASKS: dict[str, Task] = {
    "repeat_letter": Task(
        "repeat_letter",
        "'say x: ' -> repeat x; the demo task a tiny random char model learns in minutes",
        repeat_letter_rows,
        repeat_letter_eval_rows,
        repeat_letter_reward,
    ),
    "addition": Task(
        "addition",
        "'12+7=' -> '19', exact-match reward; for real models",
        addition_rows,
        addition_eval_rows,
        addition_reward,
    ),
    "digit_arithmetic": Task(
        "digit_arithmetic",
        "chat 'what is 3 * 4? answer with only the number.' -> '12'; rewards arithmetic_correct + arithmetic_format",
        digit_arithmetic_rows,
        digit_arithmetic_eval_rows,
        arithmetic_correct_reward,
    ),
    "calculator": Task(
        "calculator",
        "chat 'what is 37*8?' -> '296' with a calculator tool ('= 37*8' -> '= 296'); "
        "env.factory: asyncgrpo.environments.calculator:CalculatorEnv scores it",
        calculator_rows,
        calculator_eval_rows,
        arithmetic_correct_reward,
    ),
}
"""Built-in data sources (`data.source: builtin:<name>`)."""

REWARDS: dict[str, RewardFn] = {
    "repeat_letter": repeat_letter_reward,
    "addition": addition_reward,
    "coin": coin_reward,
    "digit_arithmetic": arithmetic_correct_reward,  # the task's own reward, like every task's
    "calculator": arithmetic_correct_reward,  # the final answer's integer (the environment adds the tool-use term)
    "arithmetic_correct": arithmetic_correct_reward,
    "arithmetic_format": arithmetic_format_reward,
}
"""Built-in reward functions (`reward.functions: [builtin:<name>]`)."""
