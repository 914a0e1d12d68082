"""Group advantages: hand-computed values, centring only, too few rewards."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.rollout.advantages import group_advantages


def test_two_winners_two_losers():
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735; 0.5 / 0.57735 = 0.866025
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True)
    expected = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    assert adv == pytest.approx([expected, -expected, -expected, expected], abs=1e-12)
    assert adv[0] == pytest.approx(0.866025, abs=1e-5)


def test_uneven_rewards():
    # rewards 1, 2, 6: mean 3, deviations -2, -1, 3, sample std sqrt(14 / 2) = sqrt(7)
    adv = group_advantages([1, 2, 6], scale_by_std=True)
    s = math.sqrt(7.0) + 1e-6
    assert adv == pytest.approx([-2 / s, -1 / s, 3 / s], abs=1e-12)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_the_std_scaling_is_the_default():
    assert group_advantages([1, 2, 6]) == group_advantages([1, 2, 6], scale_by_std=True)


def test_centring_only():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=False) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([1, 2, 6], scale_by_std=False) == pytest.approx([-2.0, -1.0, 3.0])


def test_equal_rewards_give_zero_not_nan():
    assert group_advantages([0.7, 0.7, 0.7], scale_by_std=True) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("rewards", [[], [1.0]])
def test_fewer_than_two_rewards_is_an_error(rewards):
    with pytest.raises(ValueError, match="at least 2 rewards"):
        group_advantages(rewards, scale_by_std=True)


def test_non_finite_reward_is_an_error():
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([1.0, float("nan")], scale_by_std=False)
