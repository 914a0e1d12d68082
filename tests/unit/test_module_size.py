"""No module of the package is over 500 lines unless its docstring says why it must be one file (issue #21's rule:
small modules with one job; the merges of one round pushed training/trainer.py to 509 unnoticed)."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).parent
LIMIT = 500
EXCUSE = "must be one file"


def oversized(root: Path) -> list[str]:
    """The modules under `root` over LIMIT lines whose docstring does not say why they must be one file."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.count("\n")
        if lines > LIMIT and EXCUSE not in (ast.get_docstring(ast.parse(source)) or ""):
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_module_is_over_500_lines_without_saying_why():
    assert oversized(PACKAGE) == []


def test_the_rule_sees_a_long_module_and_its_excuse(tmp_path):
    (tmp_path / "long.py").write_text('"""A long module."""\n' + "x = 1\n" * LIMIT)
    (tmp_path / "excused.py").write_text(f'"""A long module that {EXCUSE}: one state machine."""\n' + "x = 1\n" * LIMIT)
    (tmp_path / "short.py").write_text('"""A short one."""\n')
    assert oversized(tmp_path) == [f"long.py: {LIMIT + 1} lines"]
