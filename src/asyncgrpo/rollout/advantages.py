"""Group-relative advantages (DESIGN.md §3 "Training").

For one group, each surviving rollout's advantage is its reward relative to the group:

    A_i = (r_i - mean(r)) / (std(r) + 1e-6)      std with ddof=1 (sample std)
    A_i =  r_i - mean(r)                          when scale_by_std is False

Invariants:
- Pure: plain floats in, plain floats out; no torch, no I/O.
- Computed over the survivors only (the rewards given); a group needs at least 2 of them,
  since one reward has no group to be relative to (and ddof=1 would divide by zero).
- Advantages of a group sum to 0 (up to rounding); a group whose rewards are all equal gets
  all-zero advantages, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], scale_by_std: bool = True) -> list[float]:
    """Advantages of one group's survivors, in the order of `rewards`.

    Raises ValueError for fewer than 2 rewards or a non-finite reward.
    """
    values = [float(r) for r in rewards]
    if len(values) < 2:
        raise ValueError(
            f"group_advantages needs at least 2 rewards (one group's survivors), got {len(values)}: "
            f"a single completion has no group to be compared with. rollout.min_group_survivors >= 2 "
            f"should have dropped this group before scoring."
        )
    bad = [r for r in values if not math.isfinite(r)]
    if bad:
        raise ValueError(f"group_advantages got non-finite rewards {bad}: every reward must be a finite number.")
    n = len(values)
    if min(values) == max(values):
        return [0.0] * n  # exactly zero: rounding in the mean must not invent a signal
    mean = math.fsum(values) / n
    centred = [r - mean for r in values]
    if not scale_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + STD_EPS) for c in centred]
