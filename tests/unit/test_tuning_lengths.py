"""tuning/lengths.py: lengths drawn as the simulator draws them (a lognormal per prompt, a lognormal factor per
generation, rounded and clamped to [1, budget]) are fitted back; those the budget cut are censored, not taken at face value."""

from __future__ import annotations

import math
import random

import pytest

from asyncgrpo.tuning.lengths import fit_lengths, population_mean

UNLIMITED = 10_000


def drawn(seed: int, median: float, sigma: float, rollout_sigma: float, budgets: tuple[int, ...], prompts: int = 300, group: int = 8):
    """(prompt, tokens, budget) as the simulator's token model gives them, each generation under one of `budgets`."""
    rng = random.Random(seed)
    rows = []
    for prompt in range(prompts):
        prompt_log = math.log(median) + sigma * rng.gauss(0, 1)
        for _ in range(group):
            budget = rng.choice(budgets)
            rows.append((prompt, max(1, min(budget, round(math.exp(prompt_log + rollout_sigma * rng.gauss(0, 1))))), budget))
    return rows


def test_lengths_recover_the_prompt_median_and_both_spreads():
    fit = fit_lengths(drawn(1, 50, 0.5, 0.3, (UNLIMITED,), prompts=600))
    assert fit.median == pytest.approx(50, rel=0.06)
    assert fit.sigma == pytest.approx(0.5, rel=0.08)
    assert fit.rollout_sigma == pytest.approx(0.3, rel=0.05)
    assert fit.truncated_share == 0 and not fit.censored


def test_lengths_the_budget_cut_are_censored_and_the_truth_recovered_where_taking_them_as_they_are_is_biased():
    rows = drawn(2, 12, 0.4, 0.3, (12,))
    fit = fit_lengths(rows)
    assert fit.censored and 0.45 < fit.truncated_share < 0.6
    assert fit.median == pytest.approx(12, rel=0.06)
    assert fit.sigma == pytest.approx(0.4, rel=0.15) and fit.rollout_sigma == pytest.approx(0.3, rel=0.1)
    naive = fit_lengths((prompt, tokens, UNLIMITED) for prompt, tokens, _ in rows)  # the same lengths, as if none were cut
    assert naive.median < 0.85 * 12 and naive.sigma < 0.6 * 0.4 and naive.rollout_sigma < 0.75 * 0.3
    assert naive.mean == fit.mean == population_mean((prompt, tokens) for prompt, tokens, _ in rows)  # the lengths as the run had them


def test_each_length_is_censored_at_its_own_budget():
    """An episode's turns run under what env.max_tokens left (a turn's `limit`): each is cut at its own budget."""
    fit = fit_lengths(drawn(3, 40, 0.5, 0.3, (64, 48, 30)))
    assert fit.median == pytest.approx(40, rel=0.08)
    assert fit.sigma == pytest.approx(0.5, rel=0.15) and fit.rollout_sigma == pytest.approx(0.3, rel=0.1)


def test_a_within_spread_far_narrower_than_the_prompts_is_recovered_too():
    """Each prompt's lengths pin its own length far more tightly than the prompts spread (the quadrature follows them)."""
    fit = fit_lengths(drawn(4, 40, 0.5, 0.05, (64,)))
    assert fit.median == pytest.approx(40, rel=0.06)
    assert fit.sigma == pytest.approx(0.5, rel=0.1) and fit.rollout_sigma == pytest.approx(0.05, rel=0.15)


def test_one_length_per_prompt_puts_all_the_spread_across_prompts():
    fit = fit_lengths(drawn(5, 12, 0.4, 0.3, (12,), prompts=2000, group=1))
    assert fit.censored and fit.rollout_sigma == 0
    assert fit.median == pytest.approx(12, rel=0.08) and fit.sigma == pytest.approx(math.hypot(0.4, 0.3), rel=0.1)


def test_lengths_all_cut_say_only_that_every_draw_reached_the_budget():
    fit = fit_lengths([(0, 12, 12), (0, 12, 12), (1, 12, 12)])
    assert (fit.median, fit.sigma, fit.rollout_sigma, fit.truncated_share) == (12, 0, 0, 1) and not fit.censored


def test_lengths_count_the_generations_cut_at_their_budget():
    assert fit_lengths([(0, 12, 12), (0, 12, 12), (1, 5, 12), (1, 7, 12)]).truncated_share == 0.5
    assert fit_lengths([(0, 5, 5), (0, 7, 12)]).truncated_share == 0.5  # the first was cut at its own budget
