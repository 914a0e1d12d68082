"""Our loss family against the peer: TRL 1.16's own GRPOTrainer code on the same fixed batch.

TRL's `_compute_loss` (the loss and its gradient) and `_generate_and_score_completions` (where it computes the
vLLM importance-sampling ratio) run unmodified on a stand-in `self` that carries only the attributes they read:
the model's forward returns fixed per-token log-probs (a leaf tensor, so both gradients can be compared), the
generator returns fixed completions and sampling log-probs. Everything is float32 and compared to float32
tolerance.

Mapping (docs/losses.md): TRL's `old_per_token_logps` is our anchor of the ratio (pi_gen under `behaviour`,
pi_prox under `decoupled`); TRL's `sampling_per_token_logps` is our pi_gen; TRL's epsilon / epsilon_high are
clip_low / clip_high (cispo: epsilon_high is cispo_clip_max); TRL's max_completion_length is
generation.max_new_tokens. One micro-batch is one update (TRL: gradient_accumulation_steps 1), every row has a
loss token (the trainer never forwards a row without one).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from asyncgrpo.loss_config import BUILTIN_TYPES, LossConfig
from asyncgrpo.training.loss import grpo_loss
from asyncgrpo.training.losses.aggregation import update_normalizer
from asyncgrpo.training.losses.corrections import off_policy_weight

LENGTHS = [6, 3, 5, 1]
B, T = len(LENGTHS), max(LENGTHS)
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
TOL = dict(rtol=2e-5, atol=2e-6)


def _batch():
    g = torch.Generator().manual_seed(7)
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    gen = -0.2 - 2.0 * torch.rand(B, T, generator=g)  # the engine's sampling log-probs
    prox = gen + 0.15 * torch.randn(B, T, generator=g)  # the trainer's at the same weights: the mismatch
    theta = prox + 0.3 * torch.randn(B, T, generator=g)  # after some training: ratios on both sides of the clip
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5])
    return mask, gen, prox, theta, adv


class _Accelerator:
    num_processes, process_index, device, sync_gradients = 1, 0, torch.device("cpu"), True

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t


def _trl_self(loss: LossConfig, *, logps, use_vllm: bool) -> SimpleNamespace:
    """The attributes TRL's GRPOTrainer reads in _compute_loss and _generate_and_score_completions."""
    cispo = loss.type == "cispo"
    args = SimpleNamespace(
        delta=None, use_bias_correction_kl=False, sapo_temperature_pos=loss.sapo_temperature_pos,
        sapo_temperature_neg=loss.sapo_temperature_neg, vespo_k_pos=loss.vespo_k_pos, vespo_lambda_pos=loss.vespo_lambda_pos,
        vespo_k_neg=loss.vespo_k_neg, vespo_lambda_neg=loss.vespo_lambda_neg, steps_per_generation=1, gradient_accumulation_steps=1,
        per_device_train_batch_size=B, gradient_checkpointing_kwargs=None,
    )
    return SimpleNamespace(
        args=args, loss_type=loss.type, importance_sampling_level=loss.importance_sampling_level, beta=0.0,
        epsilon_low=loss.clip_low, epsilon_high=loss.cispo_clip_max if cispo else loss.clip_high,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        use_vllm=use_vllm, vllm_importance_sampling_correction=use_vllm, vllm_importance_sampling_mode=loss.mismatch_correction,
        vllm_importance_sampling_clip_min=loss.mismatch_clip_min, vllm_importance_sampling_clip_max=loss.mismatch_clip_max,
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False), current_gradient_accumulation_steps=1,
        max_completion_length=T, accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )


def trl_mismatch_ratio(loss: LossConfig, old, sampling, mask):
    """`importance_sampling_ratio` as TRL's _generate_and_score_completions computes it (old: the trainer's log-probs)."""
    rows = [n for n in mask.sum(-1).tolist()]
    generated = (
        [[1, 2]] * B, [[5] * n for n in rows], None, ["c"] * B, [sampling[b, :n].tolist() for b, n in enumerate(rows)], {}, None, None,
    )
    fake = _trl_self(loss, logps=old, use_vllm=True)
    fake.__dict__.update(
        environment_factories=None, tools=[], environments=[], _generate=lambda prompts: generated,
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False, num_iterations=1,
        _calculate_rewards=lambda *a: torch.arange(B, dtype=torch.float32).unsqueeze(-1), num_generations=B,
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1), scale_rewards="group",
        reward_func_names=["r"], _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": defaultdict(list)},
    )
    out = GRPOTrainer._generate_and_score_completions(fake, [{"prompt": "p"}] * B)
    return out["importance_sampling_ratio"]


def trl_loss(loss: LossConfig, theta, old, adv, mask, is_ratio=None):
    """TRL's loss and d loss / d per-token log-probs."""
    logps = theta.clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
        "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    value = GRPOTrainer._compute_loss(_trl_self(loss, logps=logps, use_vllm=is_ratio is not None), None, inputs)
    value.backward()
    return value.detach(), logps.grad


def our_loss(loss: LossConfig, theta, gen, adv, mask, prox=None):
    logps = theta.clone().requires_grad_(True)
    normalizer = update_normalizer(loss.aggregation, mask.sum(-1).tolist(), max_new_tokens=T, micro_batches=1)
    value, _ = grpo_loss(logps, gen, adv, mask, normalizer, loss=loss, logp_prox=prox)
    value.backward()
    return value.detach(), logps.grad


def _config(**keys) -> LossConfig:
    """A LossConfig without the consistency rules: the maths of combinations the config refuses is TRL's too."""
    return LossConfig.model_construct(**keys)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", list(BUILTIN_TYPES))
def test_every_type_and_level_equals_trl_loss_and_gradient(loss_type, level):
    mask, gen, _, theta, adv = _batch()
    loss = _config(type=loss_type, importance_sampling_level=level)
    trl_value, trl_grad = trl_loss(loss, theta, gen, adv, mask)  # TRL's old = the sampler's log-probs: our behaviour
    value, grad = our_loss(loss, theta, gen, adv, mask)
    assert trl_grad.abs().sum() > 0  # something is trained
    torch.testing.assert_close(value, trl_value, **TOL)
    torch.testing.assert_close(grad * mask, trl_grad * mask, **TOL)
    torch.testing.assert_close(grad * ~mask, torch.zeros_like(grad))


@pytest.mark.parametrize("mode", MODES)
def test_each_mismatch_mode_equals_trls_importance_sampling_ratio(mode):
    mask, gen, prox, _, _ = _batch()
    for lo, hi in ((None, 3.0), (0.9, 1.1), (0.95, None)):
        loss = _config(objective="decoupled", mismatch_correction=mode, mismatch_clip_min=lo, mismatch_clip_max=hi)
        theirs = trl_mismatch_ratio(loss, prox, gen, mask)
        ours, _ = off_policy_weight(prox - gen, mask, torch.zeros(B, T, dtype=torch.long), loss)
        if mode.startswith("sequence"):
            assert theirs.shape == (B, 1)
            theirs = theirs.expand(B, T)
        torch.testing.assert_close(ours[mask], theirs[mask], **TOL)
        if (lo, hi) == (0.9, 1.1):
            assert 0 < int((ours[mask] == 1.1).sum() + (ours[mask] == 0.9).sum() + (ours[mask] == 0).sum()) < int(mask.sum())


@pytest.mark.parametrize(
    ("loss_type", "mode"),
    # TRL refuses VESPO with a sequence-level mode, and so does our config (test_loss_config.py).
    [(t, m) for t in BUILTIN_TYPES for m in MODES if not (t == "vespo" and m.startswith("sequence"))],
)
def test_decoupled_with_each_mismatch_mode_equals_trl_with_vllm_correction(loss_type, mode):
    """At staleness 0 (TRL's setting) our decoupled objective with a mismatch correction is TRL with
    vllm_importance_sampling_correction: the ratio against pi_prox, times TRL's importance_sampling_ratio."""
    mask, gen, prox, theta, adv = _batch()
    loss = _config(type=loss_type, objective="decoupled", mismatch_correction=mode, mismatch_clip_min=0.9, mismatch_clip_max=1.1)
    trl_value, trl_grad = trl_loss(loss, theta, prox, adv, mask, trl_mismatch_ratio(loss, prox, gen, mask))
    value, grad = our_loss(loss, theta, gen, adv, mask, prox=prox)
    torch.testing.assert_close(value, trl_value, **TOL)
    torch.testing.assert_close(grad * mask, trl_grad * mask, **TOL)


@pytest.mark.parametrize("loss_type", list(BUILTIN_TYPES))
def test_decoupled_is_cap_is_trls_token_truncate_at_is_cap(loss_type):
    """Without a mismatch correction the decoupled objective's weight min(pi_prox / pi_gen, is_cap) is TRL's
    token_truncate with C_max = is_cap and no C_min."""
    mask, gen, prox, theta, adv = _batch()
    prox = gen + 0.6 * (prox - gen) / (prox - gen).abs().max()  # weights up to e^0.6 = 1.8: some above the cap
    loss = _config(type=loss_type, objective="decoupled", is_cap=1.3)
    trl_view = _config(type=loss_type, mismatch_correction="token_truncate", mismatch_clip_min=None, mismatch_clip_max=1.3)
    trl_value, trl_grad = trl_loss(loss, theta, prox, adv, mask, trl_mismatch_ratio(trl_view, prox, gen, mask))
    value, grad = our_loss(loss, theta, gen, adv, mask, prox=prox)
    torch.testing.assert_close(value, trl_value, **TOL)
    torch.testing.assert_close(grad * mask, trl_grad * mask, **TOL)
