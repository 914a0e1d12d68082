"""Resolving ``reward.functions``: each entry's name and callable.

Job: turn ``builtin:<name>``, ``module:function`` (a dotted module or a path to a ``.py`` file,
user_modules.py) or ``python:<name>`` (objects.py) into (name, callable). The parent resolves for
every isolation; a reward worker process (rewards/worker.py) resolves again by the same entries.

Invariants:
- `resolve_reward` imports nothing heavy for ``builtin:<name>``; every failure is a
  `ConfigError` naming ``reward.functions[i]``, the value, what is wrong and the fix.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from asyncgrpo.errors import ConfigError
from asyncgrpo.objects import OBJECT_PREFIX, lookup
from asyncgrpo.tasks import REWARDS
from asyncgrpo.user_modules import import_user_module, lookup_attribute

BUILTIN_PREFIX = "builtin:"


def resolve_reward(spec: str, index: int) -> tuple[str, Callable[..., Any]]:
    """Turn ``builtin:<name>``, ``module:function`` or ``python:<name>`` into (name, callable).

    `module` is a dotted module path importable from sys.path or the working directory, or a
    path to a ``.py`` file; `function` may be dotted (``module:Class.method``). The name is
    the builtin's name or the last part of `function`. ``python:<name>`` is a callable passed to
    the Python API (objects.py), named `name`.
    """
    key = f"reward.functions[{index}]"
    if isinstance(spec, str) and spec.startswith(OBJECT_PREFIX):
        return spec[len(OBJECT_PREFIX):], lookup(spec, key)
    form = (
        "builtin:<name> (" + ", ".join(sorted(REWARDS)) + ") or module:function, e.g. my_rewards:score "
        "for def score(prompts, completions, **columns) in my_rewards.py"
    )
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{key} = {spec!r} is not of the form {form}.")
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name in REWARDS:
            return name, REWARDS[name]
        guess = difflib.get_close_matches(name, list(REWARDS), n=1)
        hint = f"did you mean builtin:{guess[0]}? " if guess else ""
        raise ConfigError(
            f"{key} = {spec!r}: there is no built-in reward {name!r}. Fix: {hint}built-in rewards are "
            f"{', '.join('builtin:' + r for r in sorted(REWARDS))}."
        )
    module_name, _, attr_path = spec.rpartition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"{key} = {spec!r}: the module or the function name is empty. Fix: use {form}.")
    obj = lookup_attribute(import_user_module(module_name, key, spec), module_name, attr_path, key, spec, fix=_suggest)
    if not callable(obj):
        raise ConfigError(
            f"{key} = {spec!r}: {attr_path} is a {type(obj).__name__}, not a function. Fix: point it at a function "
            f"reward(prompts, completions, **columns) -> list[float | None]."
        )
    return attr_path.rsplit(".", 1)[-1], obj


def resolve_rewards(specs: Sequence[str]) -> list[tuple[str, Callable[..., Any]]]:
    """Resolve every ``reward.functions`` entry (each error names its index)."""
    return [resolve_reward(spec, i) for i, spec in enumerate(specs)]


def _suggest(obj: Any, missing: str) -> str:
    public = [n for n in dir(obj) if not n.startswith("_")]
    close = difflib.get_close_matches(missing, public, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    functions = [n for n in public if inspect.isfunction(getattr(obj, n, None))]
    if functions:
        shown = ", ".join(functions[:10]) + (", ..." if len(functions) > 10 else "")
        return f"its functions are {shown}."
    return "it defines no public function; check the module name."
