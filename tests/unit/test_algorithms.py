"""The algorithm seam (algorithms/): one registry (its table names.py and registry.py) reads `algorithm:`, every
implementation has every hook, and no other module, the config included, branches on the algorithm's name."""

from __future__ import annotations

import ast
import typing

import pytest
import torch

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.algorithms.names import ALGORITHMS
from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config, load_config
from asyncgrpo.distill.loss import distill_advantages
from asyncgrpo.errors import ConfigError
from asyncgrpo.types import Completion, Rollout
from tests.unit.test_layers import package_modules

# Where the name may be read: the registry and its table. Anywhere, the name may index the table (`ALGORITHMS[cfg.algorithm]`).
READERS = ("algorithms.registry", "algorithms.names")


def hooks() -> set[str]:
    names = set(typing.get_type_hints(Algorithm))
    return names | {n for n, v in vars(Algorithm).items() if callable(v) and not n.startswith("_")}


def distill_config() -> Config:
    return load_config(None, ["algorithm=distill", "rollout.group_size=1", "rollout.min_group_survivors=1"])


def test_every_algorithm_the_recipe_accepts_has_an_implementation_with_every_hook():
    assert {"per_sample", "judge", "token_advantages", "build_scorer", "preflight", "describe_scoring", "config_problems",
            "eval_metrics"} <= hooks()
    for name, entry in ALGORITHMS.items():
        cfg = load_config(None, [f"algorithm={name}"]) if name == "grpo" else distill_config()
        implementation = algorithm_for(cfg)
        missing = [hook for hook in hooks() if not hasattr(implementation, hook)]
        assert not missing, f"{type(implementation).__name__} lacks {missing}"
        # The table's one fact about the algorithm agrees with it: a bound for its scorer exactly when it has one of its own.
        assert (entry.scorer_timeout is None) == (implementation.simulated_scorer() is None), name


def test_an_unknown_algorithm_names_the_key_the_value_and_the_algorithms():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm=ppo"])
    assert "algorithm: 'ppo' is not an algorithm; the algorithms are grpo, distill. Fix: set algorithm to one of them" in str(info.value)


def test_the_recipe_is_checked_against_its_algorithms_rules_when_the_algorithm_is_built():
    """Config cannot import the algorithms (they are built from a Config), so their rules on the recipe are checked by
    the registry: no algorithm exists for a recipe it refuses."""
    cfg = load_config(None, ["algorithm=distill"])
    with pytest.raises(ConfigError) as info:
        algorithm_for(cfg)
    assert str(info.value).startswith("the recipe for algorithm = 'distill': 1 config problem:\n  - algorithm = 'distill' makes each")


def names_read(tree: ast.AST) -> list[int]:
    """The lines that read a recipe's `algorithm` (`cfg.algorithm`, `self.cfg.algorithm`) other than to look it up in the
    registry's table (`ALGORITHMS[cfg.algorithm]`), or compare with an algorithm's name."""
    lines = []
    lookups = {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)
               and isinstance(node.value, ast.Name) and node.value.id == "ALGORITHMS"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "algorithm" and id(node) not in lookups:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "cfg") or (isinstance(owner, ast.Attribute) and owner.attr == "cfg"):
                lines.append(node.lineno)
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in ALGORITHMS:
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_no_module_outside_the_registry_branches_on_the_algorithm_name():
    found = [
        f"{module}:{line}"
        for module, path in package_modules().items()
        if not any(module == r or module.startswith(r + ".") for r in READERS)
        for line in names_read(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, f"the algorithm is read by name outside algorithms/registry.py (call its hooks instead): {found}"


@pytest.mark.parametrize("code", ['if cfg.algorithm == "x": pass', 'y = "distill" if self.cfg.algorithm else 0', 'z = a != "grpo"',
                                  'w = OTHER[cfg.algorithm]'])
def test_the_check_sees_a_branch_on_the_name(code):
    assert names_read(ast.parse(code)) == [1]


def test_a_lookup_in_the_registrys_table_is_not_a_branch():
    assert names_read(ast.parse("t = ALGORITHMS[cfg.algorithm].scorer_timeout")) == []


def test_a_filler_row_has_zero_distillation_advantages_and_a_rollout_without_teacher_logprobs_is_a_bug():
    """A data-parallel rank without a sequence in an update collates one filler row (no rollout, no loss token) so it
    makes the same collectives; under distillation that row used to raise as a rollout without teacher log-probs."""
    algorithm = algorithm_for(distill_config())
    completion = Completion(token_ids=(5, 6), logprobs=(-1.0, -2.0), versions=(0, 0), finish_reason="stop", dispatch_version=0)
    taught = Rollout(completion=completion, reward=0.0, advantage=0.0, teacher_logprobs=(-0.5, -3.0))
    logp_gen = torch.tensor([[-1.0, -2.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [False, False]])
    advantages = algorithm.token_advantages([taught, None], logp_gen, mask)
    expected = distill_advantages(logp_gen, torch.tensor([[-0.5, -3.0], [0.0, 0.0]]), mask)
    assert torch.equal(advantages, expected) and advantages[1].tolist() == [0.0, 0.0] and advantages[0].tolist() == [0.5, -1.0]
    untaught = Rollout(completion=completion, reward=0.0, advantage=0.0)
    with pytest.raises(AssertionError, match="no teacher log-probs"):
        algorithm.token_advantages([untaught], logp_gen[:1], mask[:1])
