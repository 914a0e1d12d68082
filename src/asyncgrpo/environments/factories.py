"""Turning `env.factory` into the callable that makes one environment per episode.

`load_factory(spec)` reads a "module:callable" spec (a dotted module importable from sys.path or
the working directory, or a path to a .py file; the callable may be dotted, e.g. a class or
`module:Class.create`). Prefixed forms ("<prefix>:...") are dispatched in `PREFIXES` before the
plain form is tried, so an adapter (e.g. `openenv:`) adds one entry there.

Invariants: every failure is a `ConfigError` naming `env.factory`, the value, what is wrong and the
fix; loading imports the module but never calls the factory (a host calls it, once per episode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from asyncgrpo.environments.agent_spec import COMMAND_PREFIX, load_agent
from asyncgrpo.environments.agent_spec import PREFIX as AGENT_PREFIX
from asyncgrpo.environments.protocol import Environment
from asyncgrpo.errors import ConfigError
from asyncgrpo.objects import lookup
from asyncgrpo.user_modules import import_user_module, lookup_attribute

KEY = "env.factory"
FORM = "module:callable, e.g. my_env:MyEnv for class MyEnv with reset(row), step(action_text) and close() in my_env.py"


def _openenv(target: str) -> Callable[[], Environment]:
    """``openenv:module:Class``: an OpenEnv Environment class (environments/openenv.py; imported only when used)."""
    from asyncgrpo.environments.openenv import openenv_factory

    return openenv_factory(target)


def _agent(spec: str) -> Callable[[], Environment]:
    """``agent:module:function`` or ``agent-command:<command line>``: an agent written against the OpenAI client, played through
    the run's gateway (agents/), never made as an environment: loading it checks the spec, and returns the agent as it is."""
    return cast("Callable[[], Environment]", load_agent(spec))


def _python_object(name: str) -> Callable[[], Environment]:
    """``python:<name>``: a factory passed to the Python API (objects.py), valid inside that run."""
    factory: Callable[[], Environment] = lookup(f"python:{name}", KEY)
    return factory


# "<prefix>" -> loader of the rest of the spec (after "<prefix>:"); adapters register here.
PREFIXES: dict[str, Callable[[str], Callable[[], Environment]]] = {
    "openenv": _openenv, "python": _python_object,
    "agent": lambda target: _agent(AGENT_PREFIX + target), "agent-command": lambda target: _agent(COMMAND_PREFIX + target),
}


def load_factory(spec: str) -> Callable[[], Environment]:
    """The callable named by `spec` (see the module docstring); a ConfigError names what is wrong and the fix."""
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in PREFIXES:
        return PREFIXES[prefix](rest)
    module_name, sep, attr_path = spec.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"{KEY} = {spec!r} is not of the form {FORM}.")
    obj = lookup_attribute(
        import_user_module(module_name, KEY, spec), module_name, attr_path, KEY, spec,
        fix=lambda _obj, _part: "name the class or function that makes an environment.",
    )
    if not callable(obj):
        raise ConfigError(
            f"{KEY} = {spec!r}: {attr_path} is a {type(obj).__name__}, not a class or function. Fix: point it at a class "
            f"(or a function taking no arguments) whose instances have reset(row), step(action_text) and close()."
        )
    return obj  # a callable; what it makes is checked at reset
