"""Measure a run and a simulation the same way, and compare them against stated tolerances.

Job: `observe` (plain numbers; commands/tune.py gives it a simulation's) and `observe_run` (a real run's
records) each give an `Observed`: trained tokens/s, trainer wait share, staleness histogram, wasted-token share and length
bias; `compare` says whether a prediction is close enough to advise from.

Definitions (the same on both sides):
- time is the training loop's: per step its wait, train and weight-sync spans, summed, plus the
  evaluations between steps (simulate.eval_s). The rest of the reporting between steps (checkpoints,
  metrics) and the baseline evaluation before the first step are left out: the simulator does not model them.
- tokens/s = trained tokens / that time; wait share = wait / that time.
- staleness: share of trained groups per staleness (step - the group's oldest generating version).
- waste = wasted tokens (stale, failed, filtered) / generated tokens.
- length bias = trained completions' mean length / the population's (per prompt the mean of its
  rollouts, then over prompts; a run's population is its finished rollouts, or with episodes its turns, as a
  simulation's is every drawn length: one per turn).

Invariant: `compare` refuses (ok False, with the reason) when tokens/s misses by more than
TOKENS_PER_S_TOLERANCE (relative) or the wait share by more than WAIT_SHARE_TOLERANCE (absolute).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from asyncgrpo.tuning.lengths import population_mean
from asyncgrpo.tuning.records import RunRecords

TOKENS_PER_S_TOLERANCE = 0.10  # relative
WAIT_SHARE_TOLERANCE = 0.05  # absolute (5 points)


@dataclass(frozen=True)
class Observed:
    tokens_per_s: float
    wait_share: float
    staleness: dict[int, float]
    waste_share: float
    length_bias: float | None
    steps: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "staleness": {str(k): v for k, v in self.staleness.items()}}


def _histogram(values: Iterable[int]) -> dict[int, float]:
    counts = Counter(values)
    total = sum(counts.values())
    return {k: round(counts[k] / total, 4) for k in sorted(counts)} if total else {}


def _loop_time(spans: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """(wait, total) seconds over (wait, train, sync) per step."""
    wait = total = 0.0
    for w, t, s in spans:
        wait += w
        total += w + t + s
    return wait, total


def observe(steps: Iterable[tuple[float, float, float]], staleness: Iterable[int], *, trained_tokens: int, trained_completions: int,
            generated_tokens: int, wasted_tokens: int, population_length: float | None, eval_s: float = 0.0) -> Observed:
    """An Observed from plain numbers: per step its (wait, train, sync) seconds, per trained group its staleness, the token
    counts, and the seconds spent evaluating between steps."""
    spans = list(steps)
    wait, total = _loop_time(spans)
    total += eval_s
    waste = wasted_tokens / generated_tokens if generated_tokens else 0.0
    bias = trained_tokens / trained_completions / population_length if trained_completions and population_length else None
    return Observed(round(trained_tokens / total, 3) if total > 0 else 0.0, round(wait / total, 4) if total > 0 else 0.0,
                    _histogram(staleness), round(waste, 4), None if bias is None else round(bias, 4), len(spans))


def observe_run(records: RunRecords) -> Observed:
    """What the real run did, by the module's definitions (its population: its finished rollouts)."""
    version_of: dict[int, int] = {}
    for r in records.rollouts:
        if r["outcome"] == "finished" and r.get("version") is not None:
            version_of[r["take"]] = min(version_of.get(r["take"], r["version"]), r["version"])
    finished = [(r["prompt"], r["tokens"]) for r in records.requests
                if r["outcome"] == "finished" and (records.config.env is not None or r.get("version") is not None)]
    staleness = [b["step"] - version_of[b["take"]] for b in records.buffered if b["outcome"] == "trained" and b["take"] in version_of]
    m = records.last_metrics
    return observe(
        ((s["wait"][1] - s["wait"][0], s["train"][1] - s["train"][0], s["sync"][1] - s["sync"][0]) for s in records.steps),
        staleness, trained_tokens=sum(records.trained_tokens), trained_completions=int(m.get("rollout/trained_completions_total") or 0),
        generated_tokens=int(m.get("rollout/generated_tokens_total") or 0), wasted_tokens=int(m.get("rollout/wasted_tokens_total") or 0),
        population_length=population_mean(finished) if finished else None,
        eval_s=sum(e["span"][1] - e["span"][0] for e in records.evals),
    )


@dataclass(frozen=True)
class Comparison:
    rows: list[dict[str, Any]]  # name, measured, predicted, error, tolerance (None: shown, not checked), ok
    ok: bool
    reasons: list[str]


def compare(measured: Observed, predicted: Observed) -> Comparison:
    """Predicted against measured; ok only when tokens/s and the wait share are within tolerance."""
    rows, reasons = [], []
    tps_error = abs(predicted.tokens_per_s - measured.tokens_per_s) / measured.tokens_per_s if measured.tokens_per_s > 0 else float("inf")
    wait_error = abs(predicted.wait_share - measured.wait_share)
    checked = [("trained tokens/s", measured.tokens_per_s, predicted.tokens_per_s, tps_error, TOKENS_PER_S_TOLERANCE, "relative"),
               ("trainer wait share", measured.wait_share, predicted.wait_share, wait_error, WAIT_SHARE_TOLERANCE, "points")]
    for name, m, p, error, tolerance, unit in checked:
        ok = error <= tolerance
        rows.append({"name": name, "measured": m, "predicted": p, "error": round(error, 4), "tolerance": tolerance, "ok": ok})
        if not ok:
            shown = f"{error:.0%}" if unit == "relative" else f"{100 * error:.1f} points"
            limit = f"{tolerance:.0%}" if unit == "relative" else f"{100 * tolerance:.0f} points"
            reasons.append(f"{name}: predicted {p:g}, measured {m:g}, off by {shown} (tolerance {limit})")
    informational: list[tuple[str, Any, Any]] = [
        ("staleness", _shown(measured.staleness), _shown(predicted.staleness)),
        ("wasted token share", measured.waste_share, predicted.waste_share),
        ("length bias", measured.length_bias, predicted.length_bias),
    ]
    for name, m, p in informational:
        rows.append({"name": name, "measured": m, "predicted": p, "error": None, "tolerance": None, "ok": None})
    return Comparison(rows, not reasons, reasons)


def _shown(histogram: Mapping[int, float]) -> str:
    return " ".join(f"{k}:{v:.0%}" for k, v in histogram.items()) or "-"


def mean_staleness(histogram: Mapping[int, float]) -> float:
    """The histogram's mean staleness (0 when empty)."""
    return sum(k * v for k, v in histogram.items())
