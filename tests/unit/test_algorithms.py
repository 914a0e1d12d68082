"""The algorithm seam (algorithms/): one registry reads `algorithm:`, every implementation has every hook,
and no other module branches on the algorithm's name."""

from __future__ import annotations

import ast
import typing

import pytest
import torch

from asyncgrpo.algorithms.base import Algorithm
from asyncgrpo.algorithms.registry import ALGORITHMS, algorithm_for
from asyncgrpo.config import Config, load_config
from asyncgrpo.distill.loss import distill_advantages
from asyncgrpo.types import Completion, Rollout
from tests.unit.test_layers import package_modules

# Where the name may be read: the registry, and the recipe's own validation (which settings each algorithm needs).
READERS = ("algorithms.registry", "config")


def hooks() -> set[str]:
    names = set(typing.get_type_hints(Algorithm))
    return names | {n for n, v in vars(Algorithm).items() if callable(v) and not n.startswith("_")}


def distill_config() -> Config:
    return load_config(None, ["algorithm=distill", "rollout.group_size=1", "rollout.min_group_survivors=1"])


def test_every_algorithm_the_recipe_accepts_has_an_implementation_with_every_hook():
    accepted = typing.get_args(Config.model_fields["algorithm"].annotation)
    assert set(accepted) == set(ALGORITHMS)
    assert {"per_sample", "judge", "token_advantages", "build_scorer", "preflight", "describe_scoring"} <= hooks()
    for name in accepted:
        cfg = load_config(None, [f"algorithm={name}"]) if name == "grpo" else distill_config()
        implementation = algorithm_for(cfg)
        missing = [hook for hook in hooks() if not hasattr(implementation, hook)]
        assert not missing, f"{type(implementation).__name__} lacks {missing}"


def names_read(tree: ast.AST) -> list[int]:
    """The lines that read a recipe's `algorithm` (`cfg.algorithm`, `self.cfg.algorithm`) or compare with an algorithm's name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "algorithm":
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


@pytest.mark.parametrize("code", ['if cfg.algorithm == "x": pass', 'y = "distill" if self.cfg.algorithm else 0', 'z = a != "grpo"'])
def test_the_check_sees_a_branch_on_the_name(code):
    assert names_read(ast.parse(code)) == [1]


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
