"""The registry: the recipe's `algorithm:` to its implementation. The only place that reads the name.

Adding an algorithm: its module in algorithms/ implementing base.py's `Algorithm`, one line in `ALGORITHMS`,
and the name in config's `algorithm` choices.

Invariants: every name config accepts for `algorithm` has an entry (tests/unit/test_algorithms.py).
"""

from __future__ import annotations

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.algorithms.distill import Distill
from asyncgrpo.algorithms.grpo import Grpo
from asyncgrpo.config import Config

ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": Grpo,
    "distill": Distill,
}


def algorithm_for(cfg: Config) -> Algorithm:
    """The implementation of `cfg.algorithm`, built from the recipe."""
    return ALGORITHMS[cfg.algorithm](cfg)
