"""Python objects that a config names: ``python:<name>`` specs, valid inside the run that passed them.

The Python API (api.py) takes reward functions, environment factories and data as objects. A
config stays plain, serialisable data (config.yaml in the run directory, checkpoints, resume
checks), so an object that cannot be named by import path (``module:function``) is named
``python:<name>`` in the config and registered here for the duration of the run; the loaders
(rewards/resolve.py `resolve_reward`, environments/factories.py, data/loading.py) look the name
up with `lookup`.

Invariants:
- An object is registered only inside `registered(...)`, which removes every name it added on
  exit (a second run in the same process starts from an empty table: nothing leaks).
- The same name registered twice at once must be the same object (two runs in two threads that
  name different objects alike are refused, never mixed up).
- `lookup` of a name that is not registered is a `ConfigError` naming the key, the value and the
  fix: a ``python:`` spec read from a recipe (e.g. a run's config.yaml given to the CLI) names an
  object that only existed in the process that passed it.
- `importable_name(obj)` is ``module:qualname`` only when importing that module in a fresh
  process gives back this very object (module-level, not ``__main__``, not a closure or lambda);
  only such objects can cross into a worker process (``isolation: process``).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from asyncgrpo.errors import ConfigError

OBJECT_PREFIX = "python:"

_lock = threading.Lock()
_table: dict[str, Any] = {}  # name (without the prefix) -> object, for the runs in progress


@contextmanager
def registered(objects: Mapping[str, Any]) -> Iterator[None]:
    """Make each ``python:<name>`` of `objects` (keys without the prefix) resolvable until the block ends."""
    added: list[str] = []
    try:
        with _lock:
            for name, obj in objects.items():
                if name in _table and _table[name] is not obj:
                    raise ConfigError(
                        f"{OBJECT_PREFIX}{name} is already in use by another run in this process with a different object. "
                        f"Fix: give the object another name (rename the function), or run one training at a time."
                    )
                if name not in _table:
                    _table[name] = obj
                    added.append(name)
        yield
    finally:
        with _lock:
            for name in added:
                _table.pop(name, None)


def lookup(spec: str, key: str) -> Any:
    """The object registered as `spec` (``python:<name>``) for config key `key`, or a ConfigError saying why not."""
    name = spec[len(OBJECT_PREFIX):]
    with _lock:
        if name in _table:
            return _table[name]
    raise ConfigError(
        f"{key} = {spec!r} names a Python object passed to asyncgrpo's Python API (asyncgrpo.Trainer), which exists only "
        f"in the process that passed it. Fix: run this through the Python API with that object again, or name an importable "
        f"one in the recipe (module:function, e.g. my_rewards:score for def score(...) in my_rewards.py)."
    )


def importable_name(obj: Any) -> str | None:
    """``module:qualname`` when a fresh process importing that module gets `obj` itself; else None."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name == "__main__":
        return None
    if "<" in qualname:  # <lambda>, <locals>: made at run time, not reachable by name
        return None
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - any failure means: not reachable by that name
        return None
    return f"{module_name}:{qualname}" if found is obj else None


def describe(obj: Any) -> str:
    """How an error message names `obj`: its qualified name and module, else its repr."""
    qualname = getattr(obj, "__qualname__", None)
    module_name = getattr(obj, "__module__", None)
    if isinstance(qualname, str):
        return f"{qualname} (defined in {module_name})" if module_name else qualname
    return repr(obj)[:80]
