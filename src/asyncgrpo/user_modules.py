"""Import a module the user names in a config value, and look an attribute up in it.

Job: `import_user_module` imports a dotted module path (from sys.path, or else the working directory)
or a path to a ``.py`` file; `lookup_attribute` walks a dotted attribute path in it. Used by every
config key that names user code: ``reward.functions`` (rewards/resolve.py), ``env.factory``
(environments/factories.py, environments/openenv.py) and the loss plug-in (training/losses/plugin.py).

Invariants:
- Every failure is a `ConfigError` naming the config key, its value, what is wrong and the fix,
  chained to the original exception: a module that cannot be found or that raises an `Exception`
  while it is imported, a missing file, a missing attribute.
- A ``.py`` file is imported once per process under a name derived from its resolved path; a file
  whose import failed is not left in `sys.modules`.
- The working directory is appended to `sys.path` only when a dotted module is not found otherwise
  (the console script does not put it there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError


def import_user_module(module_name: str, key: str, spec: str) -> Any:
    """Import `module_name` (dotted, or a path to a .py file) for config key `key` = `spec`; every failure is a ConfigError naming them."""
    if module_name.endswith(".py"):
        return _import_file(Path(module_name), key, spec)
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            cwd = os.getcwd()
            top = module_name.split(".")[0]
            if exc.name not in (top, module_name) or cwd in sys.path or "" in sys.path:
                raise
            # The console script does not put the working directory on sys.path; a reward
            # module next to the recipe is the common case, so look there too.
            sys.path.append(cwd)
            return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key} = {spec!r}: module {module_name!r} cannot be imported ({type(exc).__name__}: {exc}). Fix: check "
            f"the spelling, install the package it needs, or run from the directory holding "
            f"{module_name.split('.')[0]}.py (the working directory is searched); a path like path/to/file.py:function "
            f"also works."
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"{key} = {spec!r}: importing module {module_name!r} raised {type(exc).__name__}: {exc}. Fix: the module "
            f"fails on import; run `python -c 'import {module_name}'` to see the full error."
        ) from exc


def lookup_attribute(module: Any, module_name: str, attr_path: str, key: str, spec: str, *, fix: Callable[[Any, str], str]) -> Any:
    """The object at dotted `attr_path` in `module`; a missing part is a ConfigError naming `key`, where it was looked
    for, and `fix(object searched, missing name)`."""
    obj = module
    walked: list[str] = []
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            where = f"module {module_name!r}" if not walked else f"{module_name}:{'.'.join(walked)}"
            raise ConfigError(f"{key} = {spec!r}: {where} has no attribute {part!r}. Fix: {fix(obj, part)}")
        obj = getattr(obj, part)
        walked.append(part)
    return obj


def _import_file(path: Path, key: str, spec: str) -> Any:
    if not path.is_file():
        raise ConfigError(
            f"{key} = {spec!r}: file {str(path)!r} does not exist (looked in {path.resolve()}). Fix: give the path of "
            f"the .py file relative to the directory you run from."
        )
    unique = "asyncgrpo_user_reward_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if unique in sys.modules:
        return sys.modules[unique]
    file_spec = importlib.util.spec_from_file_location(unique, path)
    if file_spec is None or file_spec.loader is None:
        raise ConfigError(f"{key} = {spec!r}: {str(path)!r} cannot be loaded as a Python module.")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[unique] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[unique]
        raise ConfigError(
            f"{key} = {spec!r}: importing {str(path)!r} raised {type(exc).__name__}: {exc}. Fix: run "
            f"`python {path}` to see the full error."
        ) from exc
    return module
