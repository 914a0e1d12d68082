"""AdamW with bfloat16 moments (training/bf16_adamw.py, `train.optimizer_state_dtype: bfloat16`): the stochastic
rounding is unbiased, the optimizer follows float32 AdamW, the second moment decays at beta2 = 0.999 (round-to-
nearest would freeze it), the trainer trains with it, and a bad value of the key is a clear config error."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.config import load_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.training import bf16_adamw
from asyncgrpo.training.bf16_adamw import Bf16StateAdamW, stochastic_round
from tests.component.test_trainer_hardware import train_and_measure

pytestmark = pytest.mark.timeout(60)


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    spacing = 2.0**-7  # between bfloat16 neighbours in [1, 2)
    for value in (1 + 0.3 * spacing, -(1 + 0.9 * spacing)):
        values = torch.full((200_000,), value)
        rounded = stochastic_round(values, torch.Generator().manual_seed(0)).float()
        low, high = sorted((abs(value) - (0.3 if value > 0 else 0.9) * spacing, abs(value) + (0.7 if value > 0 else 0.1) * spacing))
        assert set(rounded.abs().unique().tolist()) == {low, high}
        assert abs(float(rounded.double().mean()) - value) < 0.01 * spacing  # round-to-nearest is off by 0.3 / 0.1 spacing
    again = torch.full((1000,), 1 + 0.3 * spacing)
    assert torch.equal(stochastic_round(again, torch.Generator().manual_seed(5)), stochastic_round(again, torch.Generator().manual_seed(5)))


def test_infinities_and_exact_bfloat16_values_are_kept():
    exact = torch.tensor([0.0, 1.0, -2.5, 3.0e38, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round(exact, torch.Generator().manual_seed(0)), exact.to(torch.bfloat16))


def test_the_second_moment_decays_at_beta2_0999():
    """0.999 * v is within half a bfloat16 step of v: round-to-nearest would keep v forever, stochastic rounding decays it."""
    param = torch.nn.Parameter(torch.zeros(4096))
    optimizer = Bf16StateAdamW([param], lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    param.grad = torch.ones(4096)
    optimizer.step()
    param.grad = torch.zeros(4096)
    for _ in range(500):
        optimizer.step()
    v = optimizer.state[param]["exp_avg_sq"]
    assert v.dtype == torch.bfloat16
    expected = 1e-3 * 0.999**500  # 6.1e-4; round-to-nearest stays at 1e-3
    assert float(v.double().mean()) == pytest.approx(expected, rel=0.01)


def problem(seed: int) -> tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]:
    """A least-squares problem on a matrix, a bias and a non-contiguous (transposed) matrix."""
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(16, 24, generator=gen)),
        torch.nn.Parameter(torch.randn(16, generator=gen)),
        torch.nn.Parameter(torch.randn(24, 16, generator=gen).t()),
    ]
    return params, torch.randn(64, 24, generator=gen), torch.randn(64, 16, generator=gen)


def loss_of(params: list[torch.nn.Parameter], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w, b, w2 = params
    return ((x @ w.t() + b + torch.tanh(x @ w2.t()) - y) ** 2).mean()


def test_follows_float32_adamw(monkeypatch):
    monkeypatch.setattr(bf16_adamw, "CHUNK", 100)  # several slices per matrix
    reference, x, y = problem(0)
    ours, _, _ = problem(0)
    assert not ours[2].is_contiguous()
    optimizers = [torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1), Bf16StateAdamW(ours, lr=1e-2, weight_decay=0.1, seed=3)]
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step in range(100):
        for index, (params, optimizer) in enumerate(zip((reference, ours), optimizers)):
            optimizer.zero_grad()
            loss = loss_of(params, x, y)
            loss.backward()
            optimizer.step()
            losses[index].append(float(loss.detach()))
        if step == 0:  # zero moments: the first update is float32 AdamW's, exactly
            for a, b in zip(reference, ours):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-7)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in optimizers[1].state.values())
    # Each step moves a parameter by up to lr = 1e-2 (~0.5 in all); the bfloat16 moments' rounding (2^-8 relative)
    # makes the trajectories drift apart by less than 3 steps' worth (1.3e-2 measured), the loss by < 1 %.
    for a, b in zip(reference, ours):
        assert float((a - b).detach().abs().max()) < 3e-2
    assert losses[1][-1] < 0.2 * losses[1][0]
    assert losses[1][-1] == pytest.approx(losses[0][-1], rel=0.01)


def test_same_seed_same_gradients_give_identical_updates_as_data_parallel_ranks_need():
    runs = []
    for seed in (7, 7, 8):
        params, x, y = problem(0)
        optimizer = Bf16StateAdamW(params, lr=1e-2, weight_decay=0.0, seed=seed)
        for _ in range(3):
            optimizer.zero_grad()
            loss_of(params, x, y).backward()
            optimizer.step()
        runs.append([optimizer.state[p]["exp_avg_sq"] for p in params])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))  # the seed does choose the rounding


def test_float32_and_bfloat16_adamw_states_load_into_each_other():
    params, x, y = problem(0)
    adamw = torch.optim.AdamW(params, lr=1e-2)
    loss_of(params, x, y).backward()
    adamw.step()
    ours = Bf16StateAdamW(params, lr=1e-2)
    ours.load_state_dict(adamw.state_dict())
    for p in params:
        assert ours.state[p]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"].float(), adamw.state[p]["exp_avg_sq"], rtol=2**-8, atol=0)
    ours.step()
    assert float(ours.state[params[0]]["step"]) == 2
    back = torch.optim.AdamW(params, lr=1e-2)
    back.load_state_dict(ours.state_dict())
    assert back.state[params[0]]["exp_avg"].dtype == torch.float32
    back.step()
    assert float(back.state[params[0]]["step"]) == 3


def test_the_trainer_trains_with_bfloat16_moments_in_the_direction_of_float32_adamw():
    full, _, before, after_full = train_and_measure({})
    half, _, _, after_half = train_and_measure({"optimizer_state_dtype": "bfloat16"})
    assert isinstance(half.optimizer, Bf16StateAdamW)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in half.optimizer.state.values())
    assert all(p.dtype == torch.float32 for p in half.model.parameters())
    assert after_full > before and after_half > before
    assert after_half - before == pytest.approx(after_full - before, rel=0.05)


def test_a_bad_optimizer_state_dtype_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.optimizer_state_dtype=float16"])
    message = str(info.value)
    assert "train.optimizer_state_dtype" in message and "float16" in message and "bfloat16" in message


def test_float16_precision_with_its_gradient_scaler_steps_the_bfloat16_moment_optimizer():
    trainer, _, before, after = train_and_measure({"precision": "float16", "optimizer_state_dtype": "bfloat16"}, steps=2)
    assert trainer.scaler is not None and isinstance(trainer.optimizer, Bf16StateAdamW)
    assert after > before
