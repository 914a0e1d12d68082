"""Admission and staleness: pure arithmetic on versions and counts, no tasks, no I/O.

Words (DESIGN.md §1): the trainer's step `s` trains a batch drawn from groups generated at
version `g` and produces version `s + 1`; staleness is `s - g` and must stay within K
(`rollout.max_staleness`). `next_step` is the index of the step whose batch is taken next
(every step before it has taken its batch, the one being trained included). The serving
version is what the generators have actually loaded.

Admission rule. A new group starts only while

    occupancy < (K + 1 - lag) * groups_per_step,   lag = next_step - serving_version

where occupancy counts groups in flight or buffered (not those already taken by the step
being trained). A group admitted now is served at `serving_version`; with at most
`occupancy` groups ahead of it, trained oldest first, it reaches the loss by step
`next_step + occupancy // groups_per_step <= serving_version + K`. With weights synced
after every step this is DESIGN.md's `in_flight + buffered < (K + 1) * groups_per_step`,
counting the step in training there (it is the `lag = 1` while a step trains here); the
lag term also keeps the bound when `generation.weight_sync_every > 1` leaves the serving
version behind. It needs no absolute counters, so it holds unchanged after a resume.

A group is *stale* once its staleness at a step exceeds K (`is_stale`): at `next_step`, it is
past the bound for every step still to come, so it is thrown away (in flight: cancelled; in
the buffer: dropped). "Stale" is the one word for this here and in the collector and buffer.
"""

from __future__ import annotations


def group_capacity(*, max_staleness: int, groups_per_step: int, next_step: int, serving_version: int) -> int:
    """Most groups that may be in flight, buffered or in training at once right now (never negative)."""
    lag = next_step - serving_version
    if lag < 0:
        raise ValueError(f"serving version {serving_version} is ahead of the steps taken ({next_step})")
    return max(0, (max_staleness + 1 - lag) * groups_per_step)


def may_admit_group(
    *,
    occupancy: int,
    max_staleness: int,
    groups_per_step: int,
    next_step: int,
    serving_version: int,
    free_request_slots: int,
    undispatched_rollouts: int,
    over_admit_groups: int = 0,
) -> bool:
    """Start a new group? Only under the group capacity, and only when a request slot would be free for it
    (rollouts of already-admitted groups that still wait for a slot go first).

    `over_admit_groups` (`rollout.over_admit_groups`, an opt-in) raises a non-zero capacity by that many
    groups: they race the others for the steps within the bound, and the slowest are cancelled as stale
    (more throughput, more waste, more length bias). The bound itself stays hard: the buffer and the
    cancellation on advance enforce it whatever admission did."""
    capacity = group_capacity(
        max_staleness=max_staleness,
        groups_per_step=groups_per_step,
        next_step=next_step,
        serving_version=serving_version,
    )
    if capacity > 0:
        capacity += over_admit_groups
    return occupancy < capacity and free_request_slots > undispatched_rollouts


def is_stale(*, generation_version: int, step: int, max_staleness: int) -> bool:
    """Is a group generated at `generation_version` past the staleness bound at `step` (and at every later step)?"""
    return step - generation_version > max_staleness
