"""Keys that moved to another section, so a recipe written for the old place gets an error naming the new one.

Issue 21 moved every key that exists only for `asyncgrpo simulate` out of the production sections into
simulate: (`MOVED`). A recipe or override that still uses an old key fails with a message naming each key,
its new place and the fix (`moved_message`); a checkpoint's saved config, written before the move, is read
with its keys at their new places (`at_new_places`), so resuming it reports only real changes.

Invariant: `MOVED` maps each old dotted key (or section) to the dotted key (or section) it is now, and every
new place is a key of `Config`; tests/unit/test_config.py checks both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MOVED: dict[str, str] = {
    "generation.scripted": "simulate",  # the scripted backend's keys, each under the same name
    "train.step_time_s": "simulate.step_time_s",
    "train.token_time_s": "simulate.token_time_s",
    "distill.simulated_latency_s": "simulate.teacher_latency_s",
    "distill.simulated_error_rate": "simulate.teacher_error_rate",
}


def moved_message(key: str, value: Any) -> str | None:
    """The error for an unknown `key` (dotted) that moved, or None if it did not."""
    new = MOVED.get(key)
    if new is None:
        return None
    if key == "generation.scripted" and isinstance(value, Mapping) and value:
        renames = ", ".join(f"{key}.{name} moved to {new}.{name}" for name in value)
        return f"{renames} (the simulator's keys have their own section, simulate:). Fix: rename them in the recipe (or override)."
    return f"{key} moved to {new}. Fix: rename it in the recipe (or override)."


def at_new_places(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a config tree with every moved key at its new place (a key already at the new place wins)."""
    out: dict[str, Any] = {name: dict(value) if isinstance(value, Mapping) else value for name, value in tree.items()}
    for old, new in MOVED.items():
        section, _, key = old.partition(".")
        if not isinstance(out.get(section), dict) or key not in out[section]:
            continue
        value = out[section].pop(key)
        target, _, new_key = new.partition(".")
        moved = {new_key: value} if new_key else dict(value) if isinstance(value, Mapping) else {}
        current = out.get(target)
        out[target] = {**moved, **current} if isinstance(current, Mapping) else moved
    return out
