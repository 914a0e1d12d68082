"""The registry's table: every algorithm's name, where its implementation is, and what the recipe must know of it.

Adding an algorithm is its module in algorithms/ (implementing base.py's `Algorithm`) and one line in
`ALGORITHMS`. The recipe's `algorithm:` accepts exactly these names (config/root.py), and registry.py builds
the named implementation.

Why a table on a floor below the config, naming the implementation by its `module:Class` path: the config
must know the names (to refuse an unknown one before anything runs) and one fact of each algorithm (what
bounds its scoring stage: the stall bound and the reward-functions rule), while the implementations are
built from a `Config` and use rollout's and distill's parts, so they sit above the config
(tests/unit/test_layers.py). The config importing them would be a cycle config -> algorithms -> config;
implementations registering themselves on import would make the config's answer depend on what happened to
be imported first. So the config reads this table, and the registry, above, imports the path and checks the
recipe against the algorithm's own rules (its `config_problems` hook) when it builds it.

Invariants: pure data, importing nothing of the package; every name's path is a class implementing
base.py's `Algorithm`, and `scorer_timeout` is set exactly for the algorithms that score with a scorer of
their own (tests/unit/test_algorithms.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmName:
    implementation: str
    """`module:Class` of the implementation (registry.py imports it)."""
    description: str
    """What the name means, for the recipe's reference (docs/config.md)."""
    scorer_timeout: str | None = None
    """The dotted key bounding how long the algorithm's own scorer may take over one sample (the stall bound adds it);
    None: the recipe's reward functions score (so at least one is needed, or an environment's reward)."""


ALGORITHMS: dict[str, AlgorithmName] = {
    "grpo": AlgorithmName("asyncgrpo.algorithms.grpo:Grpo", "rewards and group-relative advantages"),
    "distill": AlgorithmName("asyncgrpo.algorithms.distill:Distill", "per-token reverse KL to distill.teacher, one sample per unit",
                             scorer_timeout="distill.timeout_s"),
}
