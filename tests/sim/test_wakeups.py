"""Wake-ups of the pipeline's waiters (DESIGN.md §3, "Wake-ups and their cost"): a change wakes only the waiters it concerns.

Counted on a scripted simulation (virtual time, no faults): how often the trainer's readiness predicate runs.
"""

from __future__ import annotations

import pytest

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import load_config
from asyncgrpo.rollout.batches import Batches

GROUP_SIZE, GROUPS_PER_STEP, STEPS = 8, 4, 12


def test_a_rollout_ending_does_not_wake_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer waits for groups, not rollouts: a freed request slot wakes the dispatcher only, and a rollout's
    end wakes the trainer only when it changes what the trainer waits for (a failure lifting a group's version floor)."""
    checks = 0
    ready = Batches._ready

    def counted(self: Batches, step: int) -> bool:
        nonlocal checks
        checks += 1
        return ready(self, step)

    monkeypatch.setattr(Batches, "_ready", counted)
    cfg = load_config("recipes/simulate.yaml", [
        "data.source=builtin:repeat_letter", "data.builtin_size=64", "reward.functions=[builtin:coin]", "simulate.faults=[]",
        "simulate.latency_s={dist: lognormal, median: 0.2, sigma: 1.0}", "simulate.tokens={dist: const, value: 8}",
        "generation.max_new_tokens=8", f"generation.max_inflight={GROUP_SIZE * GROUPS_PER_STEP}",
        f"rollout.group_size={GROUP_SIZE}", f"rollout.groups_per_step={GROUPS_PER_STEP}", "rollout.max_staleness=1",
        "rollout.max_drop_fraction=1.0", "simulate.step_time_s=0.33", f"train.max_steps={STEPS}",
    ])
    sim = simulate(cfg)
    assert sim.result.outcome == "completed" and sim.result.steps == STEPS
    rollouts = sim.generator.completed  # type: ignore[attr-defined]
    assert rollouts >= GROUP_SIZE * GROUPS_PER_STEP * STEPS
    # One check per group that ended (buffered or left behind) and a few per step; waking per rollout is 8x that.
    assert checks <= 2 * (rollouts // GROUP_SIZE) + 4 * STEPS, (checks, rollouts)
