"""Drawing from the simulator's random quantities (`Distribution`: const, uniform, lognormal).

Job: `sample` draws one value with a caller's seeded `random.Random` (so a simulation is repeatable
for a seed); `mean_of` is the expected value. Shared by everything simulated: the scripted
backend's latencies and lengths (generation/scripted.py), the simulated environment
(environments/simulated.py), the simulated teacher (distill/simulated.py) and the simulator's
capacity bound and metrics (simulate.py, sim_metrics.py); below all of them so none imports another.

Invariants: `sample` never exceeds the distribution's `max` (when it has one) and draws only from
the given generator; `mean_of` is the mean before that clamp.
"""

from __future__ import annotations

import math
import random

from asyncgrpo.config import Distribution


def sample(dist: Distribution, rng: random.Random) -> float:
    """One value of `dist`, drawn with `rng`, clamped to `dist.max`."""
    if dist.dist == "const":
        value = float(dist.value)  # type: ignore[arg-type]
    elif dist.dist == "uniform":
        value = rng.uniform(dist.low, dist.high)  # type: ignore[arg-type]
    else:
        value = float(dist.median) * math.exp(float(dist.sigma) * rng.gauss(0.0, 1.0))  # type: ignore[arg-type]
    return min(value, dist.max) if dist.max is not None else value


def mean_of(dist: Distribution) -> float:
    """Expected value (before the `max` clamp) - used for the simulator's capacity bound."""
    if dist.dist == "const":
        return float(dist.value)  # type: ignore[arg-type]
    if dist.dist == "uniform":
        return (float(dist.low) + float(dist.high)) / 2  # type: ignore[arg-type]
    return float(dist.median) * math.exp(float(dist.sigma) ** 2 / 2)  # type: ignore[arg-type]
