"""Admission and staleness: pure arithmetic on versions and counts, no tasks, no I/O.

Words (DESIGN.md §1): the trainer's step `s` trains a batch drawn from groups generated at
version `g` and produces version `s + 1`; staleness is `s - g` and must stay within K
(`rollout.max_staleness`). `steps_taken` counts steps whose batch has been taken (the one
being trained included), so the next batch goes to step `steps_taken`. The serving
version is what the generators have actually loaded.

Admission rule. A new group starts only while

    occupancy < (K + 1 - lag) * groups_per_step,   lag = steps_taken - serving_version

where occupancy counts groups in flight or buffered (not those already taken by the step
being trained). A group admitted now is served at `serving_version`; with at most
`occupancy` groups ahead of it, trained oldest first, it reaches the loss by step
`steps_taken + occupancy // groups_per_step <= serving_version + K`. With weights synced
after every step this is DESIGN.md's `in_flight + buffered < (K + 1) * groups_per_step`,
counting the step in training there (it is the `lag = 1` while a step trains here); the
lag term also keeps the bound when `generation.weight_sync_every > 1` leaves the serving
version behind. It needs no absolute counters, so it holds unchanged after a resume.

A group is *doomed* once no step it could still be trained at remains: the earliest step
left is `steps_taken`, and it must be at most `version + K`.
"""

from __future__ import annotations


def group_capacity(*, max_staleness: int, groups_per_step: int, steps_taken: int, serving_version: int) -> int:
    """Most groups that may be in flight, buffered or in training at once right now (never negative)."""
    lag = steps_taken - serving_version
    if lag < 0:
        raise ValueError(f"serving version {serving_version} is ahead of the steps taken ({steps_taken})")
    return max(0, (max_staleness + 1 - lag) * groups_per_step)


def may_admit_group(
    *,
    occupancy: int,
    max_staleness: int,
    groups_per_step: int,
    steps_taken: int,
    serving_version: int,
    free_request_slots: int,
    undispatched_rollouts: int,
) -> bool:
    """Start a new group? Only under the group capacity, and only when a request slot would be free for it
    (rollouts of already-admitted groups that still wait for a slot go first)."""
    capacity = group_capacity(
        max_staleness=max_staleness,
        groups_per_step=groups_per_step,
        steps_taken=steps_taken,
        serving_version=serving_version,
    )
    return occupancy < capacity and free_request_slots > undispatched_rollouts


def is_trainable(*, generation_version: int, step: int, max_staleness: int) -> bool:
    """May a group generated at `generation_version` reach the loss at `step`?"""
    return step - generation_version <= max_staleness


def is_doomed(*, version_floor: int, steps_taken: int, max_staleness: int) -> bool:
    """Can no step that is still to be taken train a group whose tokens are at least `version_floor`?"""
    return not is_trainable(generation_version=version_floor, step=steps_taken, max_staleness=max_staleness)
