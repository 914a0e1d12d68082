"""train.loss in the trainer, on a tiny model: each token's staleness reaches the corrections, a loss plug-in trains
like its built-in twin, and every loss type normalises over its whole update (the loss maths alone:
tests/unit/test_loss_family.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_cfg, make_groups, tiny_model
from tests.unit import test_loss_family

pytestmark = pytest.mark.timeout(120)
plugins = test_loss_family.plugins  # the fixture: the plug-ins module, written to tmp_path


def test_the_trainer_feeds_each_tokens_staleness_to_the_corrections():
    """Generator log-probs far from the trainer's: a token_mask correction with a narrow range zeroes every
    weight of staleness-0 tokens, while stale tokens keep the is_cap-truncated weight and train."""
    model = tiny_model()
    cfg = make_cfg({"loss": {"objective": "decoupled", "mismatch_correction": "token_mask",
                             "mismatch_clip_min": 0.99, "mismatch_clip_max": 1.01}})
    groups = make_groups(model, 2)
    def shifted(group, version):
        rollouts = tuple(
            dataclasses.replace(r, completion=dataclasses.replace(
                r.completion, logprobs=tuple(lp - 0.5 for lp in r.completion.logprobs),
                versions=(version,) * len(r.completion.token_ids), dispatch_version=version))
            for r in group.rollouts
        )
        return dataclasses.replace(group, rollouts=rollouts)

    fresh = TorchTrainer(tiny_model(), None, cfg, version=3)
    metrics = fresh.train_step([shifted(g, 3) for g in groups])
    assert metrics["grad_norm"] == 0.0 and metrics["is_ratio/mean"] > 1.5  # every weight masked: nothing trains
    stale = TorchTrainer(tiny_model(), None, cfg, version=3)
    metrics = stale.train_step([shifted(g, 2) for g in groups])
    assert metrics["grad_norm"] > 0.0  # staleness 1: min(rho, is_cap), trained


def test_the_trainer_trains_a_plugin_like_its_builtin_twin(plugins):
    model = tiny_model()
    groups = make_groups(model, 2)
    after = []
    for loss in ({"type": f"{plugins}:ppo_clip"}, {"type": "dapo"}):
        trainer = TorchTrainer(tiny_model(), None, make_cfg({"loss": loss}))
        trainer.train_step(groups)
        after.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    assert all(torch.allclose(after[0][k], after[1][k], atol=1e-6) for k in after[0])


def test_the_trainer_normalises_each_type_over_its_whole_update():
    """One step's reported loss is the update's sum over its normaliser: dapo divides by the loss tokens, dr_grpo by
    sequences x generation.max_new_tokens, luspo by sequences; micro-batches of 3 leave each unchanged."""
    model = tiny_model()
    groups = make_groups(model, 2)
    tokens = sum(len(r.completion.token_ids) for g in groups for r in g.rollouts)
    sequences = sum(len(g.rollouts) for g in groups)
    sums = {}
    for loss_type, normaliser in (("dapo", tokens), ("dr_grpo", sequences * 32), ("luspo", sequences)):
        for micro in (64, 3):
            trainer = TorchTrainer(tiny_model(), None, make_cfg({"loss": {"type": loss_type}, "micro_batch_size": micro}))
            sums[loss_type, micro] = trainer.train_step(groups)["loss"] * normaliser
    assert trainer.cfg.generation.max_new_tokens == 32
    reference = sums["dapo", 64]
    assert reference != 0
    assert all(value == pytest.approx(reference, rel=1e-5) for value in sums.values()), sums
