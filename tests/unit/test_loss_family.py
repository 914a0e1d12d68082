"""train.loss beyond TRL's maths (test_loss_trl_peer.py has that): the staleness and mismatch corrections kept
apart by each token's staleness, the config rules that refuse what cannot be right, and the loss plug-in (in the trainer, on a tiny model:
tests/component/test_loss_family_trainer.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from asyncgrpo.check import check_recipe
from asyncgrpo.config import load_config, tolerance_warnings
from asyncgrpo.errors import ConfigError
from asyncgrpo.loss_config import LossConfig
from asyncgrpo.training.loss import grpo_loss
from asyncgrpo.training.losses.corrections import off_policy_weight
from asyncgrpo.training.losses.plugin import resolve_loss_plugin

LN = math.log

PLUGINS = '''
import torch

def ppo_clip(batch):
    """dapo's per-token term, written from LossBatch."""
    ratio = torch.exp(batch.logp - batch.logp_gen)
    clipped = ratio.clamp(1 - batch.clip_low, 1 + batch.clip_high)
    return -torch.minimum(ratio * batch.advantages, clipped * batch.advantages)

def summed(batch):
    return (batch.logp * batch.advantages).sum()

def detached(batch):
    return batch.logp.detach() * batch.advantages

def as_list(batch):
    return batch.logp.tolist()

not_a_function = 3
'''


@pytest.fixture
def plugins(tmp_path):
    path = tmp_path / "my_losses.py"
    path.write_text(PLUGINS)
    return str(path)


def _weights(rho, staleness, mask, *, altered=False, **keys):
    loss = LossConfig(objective="decoupled", is_cap=2.0, **keys)
    weight, changed = off_policy_weight(torch.tensor(rho, dtype=torch.float64).log(), torch.tensor(mask), torch.tensor(staleness), loss)
    return (weight if not altered else changed).tolist()


def test_the_mismatch_correction_shapes_tokens_of_staleness_0_and_is_cap_the_stale_ones():
    rho = [[4.0, 0.5, 1.5], [4.0, 1.2, 0.2]]
    w = _weights(rho, [[0, 1, 0], [1, 1, 1]], [[True] * 3] * 2, mismatch_correction="token_mask", mismatch_clip_max=3.0)
    # fresh: 4 > C_max is masked, 1.5 kept; stale: min(rho, is_cap) whatever C_max says
    assert w == [pytest.approx([0.0, 0.5, 1.5]), pytest.approx([2.0, 1.2, 0.2])]
    # without a mismatch correction every token is truncated at is_cap, as the decoupled objective always was
    assert _weights(rho, [[0, 1, 0], [1, 1, 1]], [[True] * 3] * 2) == [pytest.approx([2.0, 0.5, 1.5]), pytest.approx([2.0, 1.2, 0.2])]


def test_a_sequence_correction_covers_sequences_whose_loss_tokens_all_have_staleness_0():
    rho = [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5], [1.5, 1.5, 7.0]]
    staleness = [[0, 0, 0], [0, 0, 1], [0, 0, 5]]
    mask = [[True, True, True], [True, True, True], [True, True, False]]  # row 2's stale token is padding
    w = _weights(rho, staleness, mask, mismatch_correction="sequence_truncate", mismatch_clip_max=3.0)
    assert w[0] == pytest.approx([3.0] * 3)  # 1.5^3 = 3.375 truncated at C_max, on every token
    assert w[1] == pytest.approx([1.5] * 3)  # one stale token: the whole sequence gets the staleness correction
    assert w[2] == pytest.approx([2.25, 2.25, 1.0])  # the product over its loss tokens only; 1 on padding
    # reported as truncated: the sequence whose product was cut, not the ones whose weight is their own ratio
    changed = _weights(rho, staleness, mask, altered=True, mismatch_correction="sequence_truncate", mismatch_clip_max=3.0)
    assert changed == [[True] * 3, [False] * 3, [False] * 3]


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["train.loss.importance_sampling_level=sequence"], ["train.loss.importance_sampling_level", "train.loss.type = 'dapo'", "grpo"]),
        (["train.loss.type=cispo", "train.loss.importance_sampling_level=sequence"], ["train.loss.importance_sampling_level", "'cispo'"]),
        (["train.loss.mismatch_correction=sequence_mask"], ["train.loss.mismatch_correction", "train.loss.objective = 'behaviour'", "decoupled"]),
        (["train.loss.type=vespo", "train.loss.objective=decoupled", "train.loss.mismatch_correction=sequence_truncate"],
         ["train.loss.mismatch_correction", "train.loss.type = 'vespo'", "token_truncate"]),
        (["train.loss.type=dapo", "train.loss.normalization=sequence"], ["train.loss.normalization", "train.loss.type = 'dapo'"]),
        (["train.loss.objective=decoupled", "train.loss.mismatch_correction=token_mask", "train.loss.mismatch_clip_min=3",
          "train.loss.mismatch_clip_max=1"],
         ["train.loss.mismatch_clip_min", "train.loss.mismatch_clip_max"]),
        (["train.loss.objective=decoupled", "train.loss.mismatch_correction=token_truncate", "train.loss.mismatch_clip_max=null"],
         ["train.loss.mismatch_correction", "mismatch_clip_max"]),
        (["train.loss.type=ppo"], ["train.loss.type = 'ppo'", "module:function"]),
    ],
)
def test_combinations_that_cannot_be_right_are_config_errors_naming_both_keys_and_the_fix(overrides, keys):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert all(key in message for key in keys), message
    assert "Fix:" in message


def test_normalization_alone_keeps_its_old_objective_and_luspo_with_token_ratios_warns():
    assert load_config(None, ["train.loss.normalization=sequence"]).train.loss.type == "grpo"
    assert load_config(None, ["train.loss.normalization=token"]).train.loss.type == "dapo"
    assert load_config(None, []).train.loss.type == "dapo"
    warned = tolerance_warnings(load_config(None, ["train.loss.type=luspo"]))
    assert any("train.loss.importance_sampling_level: sequence" in w for w in warned)
    assert not tolerance_warnings(load_config(None, ["train.loss.type=luspo", "train.loss.importance_sampling_level=sequence"]))


@pytest.mark.parametrize(("normalization", "builtin"), [("token", "dapo"), ("sequence", "grpo")])
def test_a_plugin_computing_ppo_clip_equals_the_builtin_loss_and_gradient(plugins, normalization, builtin):
    g = torch.Generator().manual_seed(1)
    gen = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    theta = gen + 0.4 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    normalizer = int(mask.sum()) if normalization == "token" else 3
    results = []
    for loss, plugin in ((LossConfig(type=f"{plugins}:ppo_clip", normalization=normalization), resolve_loss_plugin(f"{plugins}:ppo_clip")),
                         (LossConfig(type=builtin), None)):
        leaf = theta.clone().requires_grad_(True)
        value, _ = grpo_loss(leaf, gen, adv, mask, normalizer, loss=loss, plugin=plugin)
        value.backward()
        results.append((value.item(), leaf.grad))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize(
    ("name", "says"),
    [("summed", "shape ()"), ("as_list", "a list"), ("detached", "no gradient")],
)
def test_a_plugin_returning_the_wrong_thing_is_a_config_error_naming_it(plugins, name, says):
    spec = f"{plugins}:{name}"
    leaf = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ConfigError) as err:
        grpo_loss(leaf, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3, dtype=torch.bool), 6,
                  loss=LossConfig(type=spec), plugin=resolve_loss_plugin(spec))
    assert f"train.loss.type = {spec!r}" in str(err.value) and says in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [("no_such_module_for_losses:fn", "cannot be imported"), ("{}:missing", "has no attribute 'missing'"), ("{}:not_a_function", "not a function")],
)
def test_a_plugin_that_cannot_load_is_a_config_error_before_any_model_loads(plugins, tmp_path, spec, says):
    spec = spec.format(plugins)
    with pytest.raises(ConfigError) as err:
        resolve_loss_plugin(spec)
    assert "train.loss.type" in str(err.value) and says in str(err.value)
    # `asyncgrpo check` (and train's preflight) resolve it with the reward functions, before the model
    cfg = load_config(None, [f"train.loss.type={spec}", f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="train.loss.type"):
        check_recipe(cfg)


def test_the_worked_example_in_docs_losses_md_is_dual_clip_ppo(tmp_path):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text(encoding="utf-8")
    code = doc.split("<!-- plugin-example -->\n```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_losses.py").write_text(code)
    spec = f"{tmp_path / 'my_losses.py'}:dual_clip_ppo"
    fn = resolve_loss_plugin(spec)
    gen = torch.zeros(1, 3, dtype=torch.float64)
    theta = torch.tensor([[LN(10.0), LN(1.1), LN(10.0)]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    per_token = []
    for adv in (-1.0, 2.0):
        loss, _ = grpo_loss(theta, gen, torch.tensor([adv], dtype=torch.float64), mask, 1, loss=LossConfig(type=spec), plugin=fn)
        per_token.append(loss.item())
    # A = -1: ratio 10 would give PPO 10, dual clip caps it at 3; ratio 1.1 gives 1.1. A = +2: clipped at 1.28.
    assert per_token[0] == pytest.approx(3.0 + 1.1 + 3.0)
    assert per_token[1] == pytest.approx(-2 * (1.28 + 1.1 + 1.28))
