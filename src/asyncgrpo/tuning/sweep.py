"""Sweep configs around a calibrated run on virtual time; find the frontier and recommend one.

Job: `candidates` lists the configs to try (dotted overrides of the calibrated recipe): every staleness
bound in {K-1 .. K+2} with every staleness policy and generation.max_inflight in {M/2, M, 2M}, plus
rollout.groups_per_step at G/2 and 2G for every policy at the run's K and M (with eval.every_steps scaled to
evaluate as often per trained group): 56 with the four policies every backend
has, 70 where `resume` is possible too (`policies_for`: only the policies the run's own config accepts, so advice can
always be applied to it), the run's own first. `run_sweep` simulates each; `frontier` keeps the ones no other beats on every axis (tokens/s,
length bias, waste, staleness); `recommend` picks the fastest within the user's constraints.

Invariants: the run's own config is always a candidate and the baseline; a recommendation is another
config only when it is predicted faster by more than the validation tolerance (a smaller gain is within
the model's error), else the advice is to keep the run's config; a generation width beyond the widest the
run reached is never recommended (no decode data there); a config that fails to validate or
whose simulation does not complete is reported with why, never ranked.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.rollout import RolloutConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.tuning.calibrate import with_overrides
from asyncgrpo.tuning.observe import TOKENS_PER_S_TOLERANCE, Observed, mean_staleness

POLICIES: tuple[str, ...] = typing.get_args(RolloutConfig.model_fields["on_stale"].annotation)
KEYS = ("rollout.max_staleness", "rollout.on_stale", "generation.max_inflight", "rollout.groups_per_step")


def policies_for(run_config: dict[str, Any]) -> tuple[str, ...]:
    """The staleness policies the run's own config validates with (resume needs a backend that keeps tokens)."""
    valid = []
    for policy in POLICIES:
        try:
            with_overrides(run_config, {"rollout.on_stale": policy})
        except ConfigError:
            continue
        valid.append(policy)
    return tuple(valid)


def candidates(k: int, policy: str, inflight: int, groups: int, policies: tuple[str, ...] = POLICIES,
               eval_every: int = 0) -> list[dict[str, Any]]:
    """The sweep's configs as full override sets over KEYS, the run's own first, without duplicates.

    A run that evaluates (`eval_every` = eval.every_steps > 0) keeps its evaluations per trained group: a config
    with another groups_per_step also sets eval.every_steps (scaled, rounded, at least 1), else fewer, larger
    steps would look faster only by evaluating less often."""
    own = dict(zip(KEYS, (k, policy, inflight, groups)))
    found = [own]
    for staleness in range(max(0, k - 1), k + 3):
        for on_stale in policies:
            for width in sorted({max(1, inflight // 2), inflight, inflight * 2}):
                found.append(dict(zip(KEYS, (staleness, on_stale, width, groups))))
    for on_stale in policies:
        for size in sorted({max(1, groups // 2), groups * 2} - {groups}):
            cadence = {"eval.every_steps": max(1, round(eval_every * groups / size))} if eval_every else {}
            found.append({**dict(zip(KEYS, (k, on_stale, inflight, size))), **cadence})
    unique: dict[tuple[Any, ...], dict[str, Any]] = {}
    for overrides in found:
        unique.setdefault(tuple(overrides.values()), overrides)
    return list(unique.values())


@dataclass(frozen=True)
class Point:
    overrides: dict[str, Any]
    observed: Observed | None
    token_efficiency: float | None
    problem: str | None  # why it was not ranked

    def to_json(self) -> dict[str, Any]:
        return {"overrides": self.overrides, "observed": self.observed.to_json() if self.observed else None,
                "token_efficiency": self.token_efficiency, "problem": self.problem}


def run_sweep(recipe: dict[str, Any], configs: Iterable[dict[str, Any]], steps: int,
              simulate_one: Callable[[Any], tuple[Observed, float | None, str | None]]) -> list[Point]:
    """Simulate each config for `steps` steps; `simulate_one(Config)` gives (observed, token efficiency, problem or None)."""
    points = []
    for overrides in configs:
        try:
            cfg = with_overrides(recipe, {**overrides, "train.max_steps": steps})
        except ConfigError as exc:
            points.append(Point(overrides, None, None, f"not a valid config: {exc}"))
            continue
        observed, efficiency, problem = simulate_one(cfg)
        points.append(Point(overrides, observed, efficiency, problem))
    return points


def _axes(p: Point) -> tuple[float, float, float, float]:
    """Larger is better on every axis: tokens/s, -|1 - length bias|, -waste, -mean staleness."""
    assert p.observed is not None
    o = p.observed
    return (o.tokens_per_s, -abs(1 - (o.length_bias if o.length_bias is not None else 1.0)), -o.waste_share, -mean_staleness(o.staleness))


def frontier(points: list[Point]) -> list[Point]:
    """The ranked points no other ranked point beats (at least as good on every axis, better on one); fastest first.
    Points that tie on every axis (a policy that never acted) appear once: the first swept, so the run's own when it ties."""
    ranked = [p for p in points if p.observed is not None and p.problem is None]
    kept: dict[tuple[float, ...], Point] = {}
    for p in ranked:
        a = _axes(p)
        if not any(all(x >= y for x, y in zip(_axes(q), a)) and _axes(q) != a for q in ranked):
            kept.setdefault(a, p)
    return sorted(kept.values(), key=lambda p: -_axes(p)[0])


@dataclass(frozen=True)
class Recommendation:
    point: Point
    changes: dict[str, Any]  # the overrides that differ from the run's config ({}: keep it)
    reason: str


def recommend(points: list[Point], *, max_staleness: int | None, min_length_bias: float | None,
              widest: int | None = None) -> Recommendation:
    """The fastest point within the constraints, or the run's own (points[0]) when it meets them and none beats it by more
    than the tolerance (a run's config outside the user's constraints is never the advice, even when it is the fastest).

    `widest`: the most rollouts the run had open at once. A config with a wider generation.max_inflight is shown but
    never recommended: the decode model has no data there (a server may time out or slow down beyond what was seen)."""
    base = points[0]
    if base.observed is None:
        raise ConfigError(f"the run's own config did not simulate: {base.problem}")

    def allowed(p: Point) -> bool:
        o = p.observed
        if o is None or p.problem is not None:
            return False
        if max_staleness is not None and p.overrides["rollout.max_staleness"] > max_staleness:
            return False
        if widest is not None and p.overrides["generation.max_inflight"] > widest:
            return False
        return min_length_bias is None or (o.length_bias is not None and o.length_bias >= min_length_bias)

    fits = sorted((p for p in points if allowed(p)), key=lambda p: (-_axes(p)[0], mean_staleness(p.observed.staleness) if p.observed else 0))
    limits = ", ".join(text for text in (f"staleness <= {max_staleness}" if max_staleness is not None else "",
                                         f"length bias >= {min_length_bias}" if min_length_bias is not None else "",
                                         f"max_inflight <= {widest} (the widest the run reached)" if widest is not None else "") if text)
    within = f" within {limits}" if limits else ""
    b = base.observed
    if not fits:
        return Recommendation(base, {}, f"no swept config meets the constraints ({limits}); the run's config stays.")
    best = fits[0]
    assert best.observed is not None
    gain = best.observed.tokens_per_s / b.tokens_per_s - 1 if b.tokens_per_s > 0 else 0.0
    base_fits = allowed(base)
    if best is base or (base_fits and gain <= TOKENS_PER_S_TOLERANCE):
        return Recommendation(base, {}, f"no config{within} is predicted more than {TOKENS_PER_S_TOLERANCE:.0%} faster than the run's "
                              f"({b.tokens_per_s:g} trained tokens/s, the best is {gain:+.0%}), which is inside the prediction's error: keep it.")
    changes = {k: v for k, v in best.overrides.items() if v != base.overrides.get(k)}
    o = best.observed
    versus = (f"{gain:+.0%} over the run's config, whose trainer waits for batches {b.wait_share:.0%} of its time" if base_fits else
              f"{gain:+.0%} against the run's config, which is outside the constraints: the fastest config inside them")
    reason = (f"predicted {o.tokens_per_s:g} trained tokens/s ({versus}) with length bias {o.length_bias}, mean staleness "
              f"{mean_staleness(o.staleness):.2f} and {o.waste_share:.0%} of generated tokens wasted{within}.")
    return Recommendation(best, changes, reason)
