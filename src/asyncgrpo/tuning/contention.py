"""Fit how much generation and training slow each other where they share hardware (simulate.contention): pure, no I/O.

Job: the simulator's contention model (generation/contention.py) does a span's work at full speed while the other
side is idle and `factor` times slower while it is busy, so a span of `elapsed` seconds of which `contended` overlapped
the other side did `elapsed - contended + contended / factor` seconds of work. `fit_contended` fits that work as a line
in the span's own predictors (tokens, a constant) by least squares, with g = 1 / factor as one more coefficient:

    elapsed - contended = sum_j c_j * predictor_j - g * contended

that is, fitted separately, the rate of the spans' uncontended seconds and that of their contended ones. `busy_windows`
and `Overlap` say how much of a span the other side was busy (rollouts open: generation; train spans: training).

Invariants: a factor is returned only when the records show one: at least MIN_SHARE of the spans' time was contended
and as much was not, 0 < g, the slowdown 1 / g is at least MIN_FACTOR
(smaller ones are within the prediction's tolerance) and more than SIGNIFICANCE standard errors from 1, and every other
coefficient is non-negative; otherwise None, and the caller fits as if the sides were independent (factor 1). A run
whose spans were all contended, or all not, cannot show one: an asynchronous run's rollouts nearly all overlap training,
a synchronous one's none; records pooled from both (`asyncgrpo tune RUN --pool OTHER_RUN`) can.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SIGNIFICANCE = 3.0  # standard errors from 1 (no contention)
MIN_FACTOR = 1.05  # a smaller slowdown is within the validation tolerance: not worth a model
MIN_SHARE = 0.10  # of the spans' time, contended and not: a few spans on one side (a first batch) cannot tell a slowdown from a load


def busy_windows(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) spans as sorted, disjoint windows."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


class Overlap:
    """Seconds of a span inside disjoint sorted windows, O(log windows) per span."""

    def __init__(self, windows: Sequence[tuple[float, float]]) -> None:
        self._starts = [a for a, _ in windows]
        self._ends = [b for _, b in windows]
        self._before = [0.0]  # busy seconds of the windows before each index
        for a, b in windows:
            self._before.append(self._before[-1] + b - a)

    def _busy_until(self, t: float) -> float:
        i = bisect.bisect_right(self._starts, t)  # windows starting at or before t
        if i == 0:
            return 0.0
        return self._before[i - 1] + min(t, self._ends[i - 1]) - self._starts[i - 1]

    def __call__(self, start: float, end: float) -> float:
        return max(0.0, self._busy_until(end) - self._busy_until(start))


@dataclass(frozen=True)
class ContendedFit:
    coefficients: list[float]  # of the predictors, at full speed
    factor: float  # the slowdown while contended
    factor_se: float
    sse: float  # of elapsed - contended, as the fit predicts it


def fit_contended(predictors: Sequence[Sequence[float]], elapsed: Sequence[float], contended: Sequence[float]) -> ContendedFit | None:
    """The work line and the contention factor (see the module docstring), or None when the records show no contention."""
    share = math.fsum(contended) / math.fsum(elapsed) if math.fsum(elapsed) > 0 else 0.0
    if not MIN_SHARE <= share <= 1 - MIN_SHARE:
        return None
    rows = [[*p, -c] for p, c in zip(predictors, contended)]
    ys = [e - c for e, c in zip(elapsed, contended)]
    solved = least_squares(rows, ys)
    if solved is None:
        return None
    coefficients, ses, sse = solved
    g, se = coefficients[-1], ses[-1]
    if not 0 < g or any(c < 0 for c in coefficients[:-1]) or math.isnan(se):
        return None
    factor = 1 / g
    factor_se = se / (g * g)
    if factor < MIN_FACTOR or factor - 1 <= SIGNIFICANCE * factor_se:
        return None
    return ContendedFit(coefficients[:-1], factor, factor_se, sse)


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[float], list[float], float] | None:
    """Ordinary least squares y = rows . b: (b, standard errors (nan with no degrees of freedom), residual sum of squares);
    None when the predictors are collinear (a column all zero: no span was contended, or none was not)."""
    k, n = len(rows[0]) if rows else 0, len(rows)
    if n < k or k == 0:
        return None
    xtx = [[math.fsum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    xty = [math.fsum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    inverse = _inverse(xtx)
    if inverse is None:
        return None
    b = [math.fsum(inverse[i][j] * xty[j] for j in range(k)) for i in range(k)]
    sse = math.fsum((y - sum(x * c for x, c in zip(r, b))) ** 2 for r, y in zip(rows, ys))
    variance = sse / (n - k) if n > k else math.nan
    return b, [math.sqrt(max(0.0, variance * inverse[i][i])) for i in range(k)], sse


def _inverse(matrix: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan inverse with partial pivoting; None when singular (a pivot below 1e-12 of its column's diagonal)."""
    k = len(matrix)
    scale = [abs(matrix[i][i]) for i in range(k)]
    a = [row[:] + [1.0 if i == j else 0.0 for j in range(k)] for i, row in enumerate(matrix)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale[col] or scale[col] == 0:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        a[col] = [x / p for x in a[col]]
        for r in range(k):
            if r != col and a[r][col] != 0:
                f = a[r][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [row[k:] for row in a]
