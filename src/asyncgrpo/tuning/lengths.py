"""Fit the simulator's completion-length model to a run's lengths, the lengths its budget cut as right-censored.

Job: `fit_lengths` takes (prompt id, tokens, budget) per finished generation (a rollout, or an episode's turn; the
budget is the max_new_tokens it ran under) and returns the token model's lengths (`LengthFit`): the lognormal of a
prompt's length (median, sigma across prompts) and the spread of each generation around it (`rollout_sigma`).
`population_mean` is the mean length a length bias is measured against (observe.py), with no fit.

The model is the simulator's (generation/scripted.py, token mode): a prompt's log length is drawn once, normal
(log median, sigma); each generation adds a normal (0, rollout_sigma) to it; the draw is rounded and clamped to
[1, budget]. A length n below its budget says the draw rounded to n; a length at its budget (the engine stopped it
there) says only that the draw was at least budget - 1/2: a right-censored observation. Taken at face value, cut
lengths put the median and both spreads low, the more so the more of them the budget cut (the calculator recipe:
73 % of its turns cut at 12 tokens, simulated 8.4 tokens per turn against 9.6).

- No length cut: the moments of the log lengths (each prompt's mean; the pooled spread within prompts; the variance
  of the prompts' means less what the within spread explains).
- Some cut: maximum likelihood of the model above, each length the probability of its interval of draws (n +- 1/2;
  at its budget, budget - 1/2 and beyond), a prompt's own log length integrated out by Gauss-Hermite quadrature,
  maximised by Nelder-Mead (three parameters, in logs for the spreads) from the moments' values.
- No prompt with two lengths: spread within and across prompts cannot be told apart, so all of it is across prompts
  (rollout_sigma 0), as the moments put it.
- Every length cut: nothing says how far beyond the budget the draws went; the moments (every draw at the budget,
  which the simulator then cuts exactly as the run was cut).

Invariants: deterministic; median > 0 and both spreads >= 0 and finite (the search keeps each spread within
[MIN_SIGMA, MAX_SIGMA]); the censored fit starts from the moments' values (spreads brought into those bounds) and is
never worse in likelihood than that start (Nelder-Mead never gives up its best point). Lengths under a budget of 1
say nothing (any draw gives 1 token) and are left out of the censored fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

QUADRATURE_NODES = 16  # Gauss-Hermite nodes over a prompt's own log length, placed on its posterior (_posterior)
MIN_SIGMA, MAX_SIGMA = 1e-3, 5.0  # the search's bounds on either spread (of a log length)


@dataclass(frozen=True)
class LengthFit:
    median: float  # of a prompt's length (lognormal across prompts)
    sigma: float  # across prompts, of the log length
    rollout_sigma: float  # within a group, of the log length around the prompt's
    mean: float  # population mean (population_mean): per prompt the mean of its lengths, then over prompts
    truncated_share: float  # lengths at their budget (cut)
    censored: bool = False  # fitted with the cut lengths censored (some were cut, not all)


def population_mean(lengths: Iterable[tuple[int, int]]) -> float:
    """Per prompt the mean of its lengths ((prompt id, tokens)), then the mean over prompts."""
    per_prompt: dict[int, list[int]] = {}
    for prompt, tokens in lengths:
        per_prompt.setdefault(prompt, []).append(tokens)
    if not per_prompt:
        raise ValueError("no finished rollouts to measure the population's length from")
    return statistics.fmean(statistics.fmean(tokens) for tokens in per_prompt.values())


def fit_lengths(lengths: Iterable[tuple[int, int, int]]) -> LengthFit:
    """The token model's lengths from (prompt id, tokens, budget) of finished generations; see the module docstring."""
    rows = [(prompt, max(1, tokens), max(1, budget)) for prompt, tokens, budget in lengths]
    if not rows:
        raise ValueError("no finished rollouts to fit lengths from")
    cut = [tokens >= budget for _, tokens, budget in rows]
    mean = population_mean((prompt, tokens) for prompt, tokens, _ in rows)
    truncated = sum(cut) / len(rows)
    centre, across, within = _moments(rows)
    if any(cut) and not all(cut):
        centre, across, within = _censored(rows, (centre, across, within))
        return LengthFit(math.exp(centre), across, within, mean, truncated, censored=True)
    return LengthFit(math.exp(centre), across, within, mean, truncated)


def _moments(rows: Sequence[tuple[int, int, int]]) -> tuple[float, float, float]:
    """(mean log length, sigma across prompts, sigma within) by the moments of the logs, cut lengths at face value."""
    per_prompt: dict[int, list[float]] = {}
    for prompt, tokens, _ in rows:
        per_prompt.setdefault(prompt, []).append(math.log(tokens))
    means = {p: statistics.fmean(logs) for p, logs in per_prompt.items()}
    within_ss = sum((x - means[p]) ** 2 for p, logs in per_prompt.items() for x in logs)
    within_df = sum(len(logs) - 1 for logs in per_prompt.values())
    within_var = within_ss / within_df if within_df > 0 else 0.0
    between_var = statistics.pvariance(means.values()) if len(means) > 1 else 0.0
    mean_group = statistics.fmean(len(logs) for logs in per_prompt.values())
    across_var = max(0.0, between_var - within_var / mean_group)
    return statistics.fmean(means.values()), math.sqrt(across_var), math.sqrt(within_var)


def _censored(rows: Sequence[tuple[int, int, int]], start: tuple[float, float, float]) -> tuple[float, float, float]:
    """(mean log length, sigma across, sigma within) maximising the likelihood of the intervals of draws the lengths say (a
    budget of 1 says nothing: any draw gives 1 token)."""
    rows = [row for row in rows if row[2] > 1]
    intervals = sorted({_interval(tokens, budget) for _, tokens, budget in rows})
    column = {interval: i for i, interval in enumerate(intervals)}
    lo, hi = (np.array(edge, dtype=float) for edge in zip(*intervals))
    grouped = len({prompt for prompt, _, _ in rows}) < len(rows)  # some prompt has two lengths: the spreads can be told apart
    pairs: dict[tuple[int, int], int] = {}
    for prompt, tokens, budget in rows:
        key = (prompt if grouped else 0, column[_interval(tokens, budget)])
        pairs[key] = pairs.get(key, 0) + 1
    ordered = sorted(pairs.items())
    groups = np.array([g for (g, _), _ in ordered])
    columns = np.array([c for (_, c), _ in ordered])
    counts = np.array([n for _, n in ordered], dtype=float)
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    index = np.cumsum(np.r_[False, groups[1:] != groups[:-1]])  # each pair's group, 0..groups-1
    # Per group, what centres its quadrature: its uncut lengths' count and sum of logs; its cut ones' count and least edge.
    cut_pair = ~np.isfinite(hi[columns])
    log_tokens = np.log(np.where(np.isfinite(lo[columns]), np.exp(lo[columns]) + 0.5, 1.0))
    uncut_n = np.bincount(index, weights=counts * ~cut_pair)
    uncut_sum = np.bincount(index, weights=counts * ~cut_pair * log_tokens)
    cut_n = np.bincount(index, weights=counts * cut_pair)
    cut_edge = np.full(len(starts), np.inf)
    np.minimum.at(cut_edge, index[cut_pair], lo[columns][cut_pair])
    nodes, weights = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES) if grouped else (np.zeros(1), np.ones(1))
    log_weights = np.log(weights / weights.sum()) + nodes**2 / 2  # with the standard normal's density divided out

    def negative_loglik(theta: np.ndarray) -> float:
        mu, across, within = theta[0], math.exp(theta[1]), math.exp(theta[2])
        if not (MIN_SIGMA <= across <= MAX_SIGMA and MIN_SIGMA <= within <= MAX_SIGMA):
            return math.inf
        if grouped:  # a prompt's own offset: its nodes placed on its posterior (_posterior)
            centre, scale = _posterior(mu, across, within, uncut_n, uncut_sum, cut_n, cut_edge)
            offsets = centre[:, None] + scale[:, None] * nodes[None, :]  # (groups, nodes)
            log_prior = -offsets**2 / (2 * across**2) - math.log(across) + np.log(scale)[:, None]
        else:
            offsets, log_prior = np.zeros((len(starts), 1)), np.zeros((len(starts), 1))
        log_p = _log_interval_prob(lo[columns][:, None], hi[columns][:, None], mu + offsets[index], within)  # (pairs, nodes)
        per_group = np.add.reduceat(counts[:, None] * log_p, starts, axis=0) + log_prior
        total = float(_logsumexp(per_group + log_weights).sum())
        return -total if math.isfinite(total) else math.inf

    centre, across, within = start
    if grouped:
        x0 = np.array([centre, math.log(_bounded(across)), math.log(_bounded(within))])
    else:  # one spread: the within one stands for it in the likelihood, reported as across
        x0 = np.array([centre, 0.0, math.log(_bounded(math.hypot(across, within)))])
    best = _nelder_mead(negative_loglik, x0, fixed=None if grouped else 1)
    if not grouped:
        return float(best[0]), math.exp(best[2]), 0.0
    return float(best[0]), math.exp(best[1]), math.exp(best[2])


def _posterior(mu: float, across: float, within: float, uncut_n: np.ndarray, uncut_sum: np.ndarray, cut_n: np.ndarray,
               cut_edge: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt, the mean and sd its own offset has given its lengths, approximately: normal from the prior and its uncut
    lengths, then moved and narrowed by its cut ones as by one draw of the offset plus a normal of variance within^2 / cut
    count that exceeded the least cut edge (the exact moments for one cut length). The quadrature's nodes go there (adaptive
    Gauss-Hermite): with nodes spread over the prior, a prompt whose lengths pin its offset far more tightly falls between them."""
    precision = 1 / across**2 + uncut_n / within**2
    centre = (uncut_sum - uncut_n * mu) / within**2 / precision
    variance = 1 / precision
    has_cut = cut_n > 0
    spread = np.sqrt(variance + within**2 / np.maximum(cut_n, 1))
    tau = np.where(has_cut, (np.where(has_cut, cut_edge, 0.0) - mu - centre) / spread, 0.0)
    ratio = np.where(has_cut, np.exp(-tau**2 / 2 - 0.5 * math.log(2 * math.pi) - _log_ndtr(-tau)), 0.0)  # phi / (1 - Phi)
    shifted = centre + variance / spread * ratio
    narrowed = variance * (1 - variance / spread**2 * ratio * (ratio - tau))
    return shifted, np.sqrt(np.maximum(narrowed, variance * 1e-4))


def _bounded(sigma: float) -> float:
    return min(MAX_SIGMA, max(MIN_SIGMA * 10, sigma))


def _interval(tokens: int, budget: int) -> tuple[float, float]:
    """The log draws that give `tokens` under `budget`: rounded to it, clamped to [1, budget]."""
    return (-math.inf if tokens <= 1 else math.log(tokens - 0.5), math.inf if tokens >= budget else math.log(tokens + 0.5))


def _log_interval_prob(lo: np.ndarray, hi: np.ndarray, centres: np.ndarray, sigma: float) -> np.ndarray:
    """log P(lo < X < hi) for X normal(centre, sigma), elementwise (broadcast), accurate in both tails."""
    z_lo = (lo - centres) / sigma
    z_hi = (hi - centres) / sigma
    upper = z_lo > 0  # both edges above the centre: the difference of the upper tails keeps its precision
    big = np.where(upper, _log_ndtr(-z_lo), _log_ndtr(z_hi))
    small = np.where(upper, _log_ndtr(-z_hi), _log_ndtr(z_lo))
    with np.errstate(divide="ignore"):
        return big + np.log1p(-np.exp(small - big))


def _log_ndtr(z: np.ndarray) -> np.ndarray:
    """log of the standard normal CDF, by erfc's Chebyshev fit (fractional error < 1.2e-7 everywhere: Numerical Recipes,
    erfcc), in logs so that the far tails neither underflow nor lose their relative precision."""
    x = -z / math.sqrt(2.0)  # Phi(z) = erfc(x) / 2
    a = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = 1.0 / (1.0 + 0.5 * a)
        poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
            0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
        log_erfc_a = np.where(np.isinf(a), -np.inf, np.log(t) - a * a + poly)
        log_erfc = np.where(x >= 0, log_erfc_a, np.log(2.0 - np.exp(log_erfc_a)))
    return log_erfc - math.log(2.0)


def _logsumexp(values: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, per row."""
    top = values.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (safe + np.log(np.exp(values - safe).sum(axis=-1, keepdims=True)))[..., 0]


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, fixed: int | None = None, step: float = 0.2,
                 tolerance: float = 1e-9, max_evaluations: int = 3000) -> np.ndarray:
    """A minimum of `f` near `x0` by Nelder-Mead (reflect 1, expand 2, contract 1/2, shrink 1/2), coordinate `fixed` held;
    it stops when the simplex's values agree within `tolerance` (relative) or after `max_evaluations`."""
    free = [i for i in range(len(x0)) if i != fixed]
    simplex = [x0.copy()] + [x0 + step * np.eye(len(x0))[i] for i in free]
    values = [f(x) for x in simplex]
    evaluations = len(simplex)
    while evaluations < max_evaluations:
        order = np.argsort(values, kind="stable")
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) <= tolerance * (1.0 + abs(values[0])):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        evaluations += 1
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            evaluations += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * ((reflected if fr < values[-1] else simplex[-1]) - centroid)
            fc = f(contracted)
            evaluations += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
                evaluations += len(simplex) - 1
    return simplex[int(np.argmin(values))]
