"""The registry: the recipe's `algorithm:` to its implementation, built and checked against the recipe.

The names and where each implementation is live in names.py's `ALGORITHMS` (one line per algorithm, on a
floor the config can read; names.py says why). `algorithm_for` imports the named `module:Class`, builds it
from the recipe and checks the recipe against the algorithm's own rules (`config_problems`).

Invariants:
- With names.py, the only code that reads the algorithm's name (tests/unit/test_algorithms.py).
- No `Algorithm` is built for a recipe it refuses: every run's parts (the collector, the trainers, the
  commands' preflights) get theirs here, so a recipe that breaks its algorithm's rules fails with one
  ConfigError listing each broken rule, before any model loads, as config's own rules fail.
"""

from __future__ import annotations

from typing import cast

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.algorithms.names import ALGORITHMS
from asyncgrpo.config import Config, problems_error
from asyncgrpo.user_modules import import_user_module, lookup_attribute


def implementation(name: str) -> type[Algorithm]:
    """The class of the algorithm named `name` (a name config accepted), imported from its `module:Class` path."""
    path = ALGORITHMS[name].implementation
    module_name, _, attr = path.partition(":")
    module = import_user_module(module_name, "algorithm", name)
    found = lookup_attribute(module, module_name, attr, "algorithm", name,
                             fix=lambda obj, part: f"correct the path {path!r} in algorithms/names.py")
    return cast(type[Algorithm], found)


def algorithm_for(cfg: Config) -> Algorithm:
    """The implementation of `cfg.algorithm`, built from the recipe; a ConfigError listing every rule of the algorithm
    the recipe breaks."""
    algorithm = implementation(cfg.algorithm)(cfg)
    if problems := algorithm.config_problems():
        raise problems_error(f"the recipe for algorithm = {cfg.algorithm!r}", problems)
    return algorithm
