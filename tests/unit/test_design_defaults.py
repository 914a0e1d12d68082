"""The defaults the documents quote are the config's: docs/DESIGN.md's recipe block (§6) and, in DESIGN and the README,
every default quoted in prose, read from `asyncgrpo.config.Config()`.

A default is quoted in prose one of two ways, and DESIGN uses no other: `` `section.key` (default VALUE) `` (VALUE a
YAML value, up to a `)`, `:` or `;`; a key ending in `_s` may add its unit, `60 s`) or `` `section.key: VALUE`, the
default ``. DESIGN's every "(default", ", the default" and "by default" must be one of them, so a default written any
other way fails here instead of going unchecked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncgrpo.config import Config

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
README = ROOT / "README.md"

KEY = r"[a-z_]+(?:\.[a-z_]+)*"
PARENTHESISED = re.compile(rf"`({KEY})`\s+\(default\s+([^):;]+)")
THE_DEFAULT = re.compile(rf"`({KEY}):\s+([^`]+)`,\s+the\s+default")
ANY_DEFAULT = re.compile(r"\(default\b|,\s+the\s+default|\bby\s+default")
MISSING = object()


def default_of(key: str) -> Any:
    """The config's default at a dotted key (nested sections as plain data), or MISSING."""
    value: Any = Config()
    for part in key.split("."):
        if not hasattr(value, part):
            return MISSING
        value = getattr(value, part)
    return value.model_dump() if hasattr(value, "model_dump") else value


def quoted(key: str, value: str) -> Any:
    value = " ".join(value.split())
    if key.endswith("_s"):
        value = re.sub(r"\s+s$", "", value)
    return yaml.safe_load(value)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def prose_defaults(text: str, name: str) -> list[tuple[str, Any, str]]:
    """(key, quoted default, where) for every default quoted in prose in the text of the file `name`."""
    return [(match.group(1), quoted(*match.groups()), f"{name}:{line_of(text, match.start())}")
            for pattern in (PARENTHESISED, THE_DEFAULT) for match in pattern.finditer(text)]


def recipe_block_defaults() -> list[tuple[str, Any, str]]:
    """(dotted key, value, where) for every leaf of DESIGN §6's recipe block."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## 6. Configuration", 1)[1].split("\n## ", 1)[0]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    found: list[tuple[str, Any, str]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            found.append((prefix, value, "DESIGN.md §6"))

    walk("", yaml.safe_load(block))
    return found


def disagreements(quotes: list[tuple[str, Any, str]]) -> list[str]:
    wrong = []
    for key, value, where in quotes:
        actual = default_of(key)
        if actual is MISSING:
            wrong.append(f"{where}: `{key}` is not a config key")
        elif value != actual:
            wrong.append(f"{where}: `{key}` quoted with default {value!r}, the config's is {actual!r}")
    return wrong


def test_design_s_recipe_block_holds_the_config_s_defaults():
    quotes = recipe_block_defaults()
    assert len({key.split(".")[0] for key, _, _ in quotes}) >= 10, "DESIGN §6's recipe block was not found or read"
    assert not disagreements(quotes), "\n".join(disagreements(quotes))


@pytest.mark.parametrize("path", [DESIGN, README], ids=lambda path: path.name)
def test_every_default_quoted_in_prose_is_the_config_s(path):
    quotes = prose_defaults(path.read_text(encoding="utf-8"), path.name)
    assert quotes, f"{path.name}: no default quoted in prose was found (did the quoting change?)"
    assert not disagreements(quotes), "\n".join(disagreements(quotes))


def test_design_quotes_every_default_in_a_form_this_test_reads():
    text = DESIGN.read_text(encoding="utf-8")
    read = [match.span() for pattern in (PARENTHESISED, THE_DEFAULT) for match in pattern.finditer(text)]
    unread = [
        f"DESIGN.md:{line_of(text, match.start())}: {text[max(0, match.start() - 40):match.end() + 20]!r}"
        for match in ANY_DEFAULT.finditer(text)
        if not any(start <= match.start() < end for start, end in read)
    ]
    assert not unread, (
        "defaults quoted in a form tests/unit/test_design_defaults.py does not check; write "
        "`section.key` (default VALUE) or `section.key: VALUE`, the default:\n" + "\n".join(unread))


def test_a_wrong_or_unknown_quoted_default_is_reported_with_its_place():
    assert disagreements([("rollout.max_staleness", 1, "here:1")]) == []
    assert disagreements([("rollout.max_staleness", 3, "here:2"), ("rollout.nope", 1, "here:3")]) == [
        "here:2: `rollout.max_staleness` quoted with default 3, the config's is 1",
        "here:3: `rollout.nope` is not a config key",
    ]
    prose = "`generation.backend_dead_after_s` (default\n60 s) and `rollout.on_stale: requeue`, the default."
    assert prose_defaults(prose, "x") == [("generation.backend_dead_after_s", 60, "x:1"), ("rollout.on_stale", "requeue", "x:2")]
    assert disagreements(prose_defaults(prose, "x")) == ["x:2: `rollout.on_stale` quoted with default 'requeue', the config's is 'patience'"]
