"""Resolve `env.factory` into the callable that makes one environment instance per episode.

Forms: ``module:callable`` (a dotted module importable from sys.path; the callable may be
dotted, ``module:Class.make``) and ``openenv:module:Class`` (an OpenEnv server-side
`Environment` class, wrapped by environments/openenv.py).

Invariant: every bad spec is a `ConfigError` naming the key, the value and the fix; nothing
here creates an environment.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from asyncgrpo.errors import ConfigError

OPENENV_PREFIX = "openenv:"


def load_factory(spec: str) -> Callable[[], Any]:
    """The zero-argument callable `spec` names (see the module docstring for the forms)."""
    if isinstance(spec, str) and spec.startswith(OPENENV_PREFIX):
        from asyncgrpo.environments.openenv import openenv_factory

        return openenv_factory(spec[len(OPENENV_PREFIX) :])
    module_name, _, attr_path = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not attr_path:
        raise ConfigError(
            f"env.factory = {spec!r} is not of the form module:callable (e.g. my_envs:MyEnv for class MyEnv in my_envs.py) "
            f"or openenv:module:Class."
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"env.factory = {spec!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}. Fix: check the "
            f"spelling and that the module is importable (run `python -c 'import {module_name}'`)."
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"env.factory = {spec!r}: {module_name}:{attr_path} has no attribute {part!r}. Fix: name a class or function.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"env.factory = {spec!r}: {attr_path} is a {type(obj).__name__}, not a class or function.")
    return obj
