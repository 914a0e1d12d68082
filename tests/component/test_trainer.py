"""TorchTrainer on a tiny Llama: a step moves the model, version counting, exact metric keys,
LR warm-up, truncated sequences masked out, on-policy ratios, decoupled proximal policy."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import LlamaForCausalLM

from asyncgrpo.config import Config
from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.telemetry.keys import TRAIN_KEYS, offpolicy_keys
from asyncgrpo.training.trainer import NonFiniteLossError, TorchTrainer
from asyncgrpo.types import Completion, Group, Prompt, Rollout
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.timeout(60)

TEMPERATURE = 0.7


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed)


def make_cfg(train: dict | None = None, rollout: dict | None = None) -> Config:
    return Config.model_validate(
        {
            "train": {"lr": 1e-2, **(train or {})},
            "generation": {"temperature": TEMPERATURE},
            "rollout": {"group_size": 4, **(rollout or {})},
        }
    )


def own_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log pi of `completion` under `model` at TEMPERATURE: one unpadded sequence."""
    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
    return logp.tolist()


def make_groups(model, n_groups: int, *, seed: int = 0, truncated_every: int = 0, group_size: int = 4) -> list[Group]:
    """Groups of random prompts/completions of varied lengths with the model's own log-probs."""
    rng = random.Random(seed)
    groups = []
    for gid in range(n_groups):
        prompt = [1] + [rng.randrange(3, 32) for _ in range(rng.randrange(2, 7))]
        rewards = [float(rng.random() < 0.5) for _ in range(group_size - 1)] + [0.5]
        advantages = group_advantages(rewards, scale_by_std=True)
        rollouts = []
        for k in range(group_size):
            completion = [rng.randrange(3, 32) for _ in range(rng.randrange(1, 9))]
            truncated = truncated_every > 0 and k % truncated_every == 0
            comp = Completion(
                token_ids=tuple(completion),
                logprobs=tuple(own_logprobs(model, prompt, completion)),
                versions=(0,) * len(completion),
                finish_reason="length" if truncated else "stop",
                dispatch_version=0,
            )
            rollouts.append(Rollout(completion=comp, reward=rewards[k], advantage=advantages[k]))
        groups.append(Group(prompt=Prompt(id=gid, text="", token_ids=tuple(prompt)), rollouts=tuple(rollouts), seq=gid))
    return groups


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adam_steps(trainer: TorchTrainer) -> int:
    states = [s for s in trainer.optimizer.state.values() if "step" in s]
    return int(states[0]["step"])


def test_train_step_moves_model_and_returns_exact_metrics():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg())
    groups = make_groups(model, 3)
    before = weights(model)
    assert trainer.version == 0
    metrics = trainer.train_step(groups)
    assert trainer.version == 1
    assert list(metrics) == [*TRAIN_KEYS, *offpolicy_keys(1)]
    assert set(TRAIN_KEYS) == {
        "loss", "kl", "clip_frac", "is_ratio/mean", "is_ratio/max", "entropy", "grad_norm", "lr",
        "advantage/mean", "advantage/std", "completion/len_mean", "completion/len_max", "completion/truncated_frac",
    }
    assert all(isinstance(metrics[k], float) and math.isfinite(metrics[k]) for k in TRAIN_KEYS)
    after = weights(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    lengths = [len(r.completion.token_ids) for g in groups for r in g.rollouts]
    assert metrics["completion/len_max"] == max(lengths)
    assert metrics["completion/len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert metrics["completion/truncated_frac"] == 0.0
    # Generation weights are the live parameters, detached and not copied (no second full copy of
    # the model per weight sync): valid until the next step, which the pipeline awaits.
    published = trainer.generation_weights()
    assert set(published) == set(model.state_dict())
    live = {p.data_ptr() for p in model.parameters()}
    assert all(t.data_ptr() in live for t in published.values())
    assert all(not t.requires_grad for t in published.values())


def test_version_advances_once_per_step_with_two_updates():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"updates_per_batch": 2}))
    groups = make_groups(model, 4)
    trainer.train_step(groups)
    assert trainer.version == 1
    assert adam_steps(trainer) == 2  # two optimizer updates, one version
    trainer.train_step(groups)
    assert trainer.version == 2
    assert adam_steps(trainer) == 4


def test_lr_warmup_is_linear_then_constant():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"lr": 1e-3, "warmup_steps": 4}))
    groups = make_groups(model, 1)
    lrs = [trainer.train_step(groups)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3, 1e-3])


def test_mask_truncated_removes_truncated_sequences_from_the_loss():
    model = tiny_model()
    groups = make_groups(model, 2, truncated_every=2)  # rollouts 0 and 2 of each group truncated
    kept = [
        Group(prompt=g.prompt, rollouts=tuple(r for r in g.rollouts if not r.completion.truncated), seq=g.seq)
        for g in groups
    ]
    masked_model, reference_model, unmasked_model = model, copy.deepcopy(model), copy.deepcopy(model)

    masked = TorchTrainer(masked_model, None, make_cfg(rollout={"mask_truncated": True}))
    metrics = masked.train_step(groups)
    assert metrics["completion/truncated_frac"] == 0.5
    reference = TorchTrainer(reference_model, None, make_cfg(rollout={"mask_truncated": True}))
    reference.train_step(kept)
    # Same update as if the truncated rollouts were absent: they contribute no gradient.
    for name, tensor in masked_model.state_dict().items():
        torch.testing.assert_close(tensor, reference_model.state_dict()[name], rtol=0, atol=1e-6)

    unmasked = TorchTrainer(unmasked_model, None, make_cfg(rollout={"mask_truncated": False}))
    unmasked.train_step(groups)
    assert any(
        not torch.allclose(t, unmasked_model.state_dict()[k], atol=1e-6) for k, t in masked_model.state_dict().items()
    )


@pytest.mark.parametrize("objective", ["behaviour", "decoupled"])
def test_on_policy_first_update_has_unit_ratio_and_no_clipping(objective):
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"loss": {"objective": objective}}))
    metrics = trainer.train_step(make_groups(model, 4))
    # Left-padded, batched pi_theta equals the unpadded per-sequence log-probs.
    assert metrics["is_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["is_ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac"] == 0.0
    assert metrics["kl"] == 0.0


def test_decoupled_proximal_policy_is_the_step_start_weights():
    # With two updates, pi_prox of the second mini-batch must still be the weights at the
    # start of the step (= pi_gen here), so pi_prox / pi_gen stays 1 everywhere.
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"updates_per_batch": 2, "loss": {"objective": "decoupled"}}))
    metrics = trainer.train_step(make_groups(model, 4))
    assert metrics["is_ratio/max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["is_ratio/mean"] == pytest.approx(1.0, abs=1e-5)


def test_micro_batching_does_not_change_the_update():
    model = tiny_model()
    groups = make_groups(model, 3, seed=3)
    results = []
    for micro in (64, 5):
        trainer = TorchTrainer(copy.deepcopy(model), None, make_cfg({"micro_batch_size": micro}))
        results.append(trainer.train_step(groups))
    for other in results[1:]:
        assert other["loss"] == pytest.approx(results[0]["loss"], rel=1e-5, abs=1e-7)
        assert other["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)
        assert other["entropy"] == pytest.approx(results[0]["entropy"], rel=1e-6)


def test_kl_to_frozen_reference():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"loss": {"kl_coef": 0.1}}))
    assert trainer.reference is not None
    groups = make_groups(model, 2)
    first = trainer.train_step(groups)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    second = trainer.train_step(groups)
    assert second["kl"] > 0.0
    assert TorchTrainer(tiny_model(), None, make_cfg()).reference is None


def test_non_finite_loss_is_raised_and_not_applied():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg())
    group = make_groups(model, 1)[0]
    bad = group.rollouts[0]
    comp = bad.completion
    nan_comp = Completion(comp.token_ids, (float("nan"),) * len(comp.token_ids), comp.versions, comp.finish_reason, 0)
    group = Group(group.prompt, (Rollout(nan_comp, bad.reward, bad.advantage),) + group.rollouts[1:], group.seq)
    before = weights(model)
    with pytest.raises(NonFiniteLossError, match="not applied"):
        trainer.train_step([group])
    assert trainer.version == 0
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())


def test_empty_batch_is_an_error():
    trainer = TorchTrainer(tiny_model(), None, make_cfg())
    with pytest.raises(ValueError, match="at least one group"):
        trainer.train_step([])


def test_step_without_loss_tokens_changes_nothing_but_the_version():
    model = tiny_model()
    trainer = TorchTrainer(model, None, make_cfg({"weight_decay": 0.1}, rollout={"mask_truncated": True}))
    groups = make_groups(model, 2, truncated_every=1)  # every completion truncated
    before = weights(model)
    metrics = trainer.train_step(groups)
    assert trainer.version == 1
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0 and metrics["clip_frac"] == 0.0
    assert metrics["completion/truncated_frac"] == 1.0


def episode_groups(model, env_logprob: float, *, seed: int = 3) -> list[Group]:
    """Groups whose completions are episodes: model turns with the model's own log-probs, environment tokens
    between them (loss mask 0) whose recorded log-probs are `env_logprob`, and versions older than the model's."""
    rng = random.Random(seed)
    groups = []
    for gid in range(2):
        prompt = [1] + [rng.randrange(3, 32) for _ in range(4)]
        advantages = group_advantages([1.0, 0.0, 0.5, 0.0], scale_by_std=True)
        rollouts = []
        for k in range(4):
            turn1, env, turn2 = ([rng.randrange(3, 32) for _ in range(n)] for n in (3, 4, 2))
            ids = turn1 + env + turn2
            own = own_logprobs(model, prompt, ids)
            mask = (True,) * 3 + (False,) * 4 + (True,) * 2
            comp = Completion(
                token_ids=tuple(ids),
                logprobs=tuple(lp if m else env_logprob for lp, m in zip(own, mask)),
                versions=(5,) * 3 + (0,) * 4 + (6,) * 2,
                finish_reason="stop",
                dispatch_version=5,
                loss_mask=mask,
            )
            rollouts.append(Rollout(completion=comp, reward=0.0, advantage=advantages[k]))
        groups.append(Group(prompt=Prompt(id=gid, text="", token_ids=tuple(prompt)), rollouts=tuple(rollouts), seq=gid))
    return groups


def test_environment_tokens_of_an_episode_get_no_gradient():
    """The loss and the update do not depend on what was recorded for the environment's tokens (loss mask 0)."""
    results = []
    for env_logprob in (-0.1, -9.0):
        model = tiny_model(seed=4)
        groups = episode_groups(model, env_logprob)
        trainer = TorchTrainer(model, None, make_cfg())
        metrics = trainer.train_step(groups)
        results.append((metrics["loss"], metrics["is_ratio/max"], weights(trainer.model)))
    (loss_a, ratio_a, weights_a), (loss_b, ratio_b, weights_b) = results
    assert loss_a == loss_b and ratio_a == ratio_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # Staleness counts the model's tokens only: the environment's older versions do not lower it.
    assert episode_groups(tiny_model(seed=4), -1.0)[0].generation_version == 5
