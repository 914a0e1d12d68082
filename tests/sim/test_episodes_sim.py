"""Multi-turn episodes in the simulator (environments/simulated.py) on virtual time: stale cancellation of episodes
that ignore it is counted as abandoned and never as a failure; environment errors fail rollouts, counted."""

from __future__ import annotations

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import validate_config
from tests.sim.fakes import OK, Fate, ProgrammedGenerator, recipe


def env_recipe(max_steps: int = 6, **scripted_env: object):
    base = recipe(
        env={"factory": "simulated:env", "max_turns": 4, "max_tokens": 512, "cancel_grace_s": 0.5},
        generation={"max_inflight": 16, "request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0},
        rollout={"group_size": 2, "groups_per_step": 1, "max_staleness": 1, "max_requeues": 1},
        train={"backend": "stub", "max_steps": max_steps},
        simulate={"step_time_s": 1.0, "env": {"call_s": {"dist": "uniform", "low": 0.0, "high": 2.0}, "done_prob": 0.0, **scripted_env}},
    )
    return validate_config(base.model_dump(mode="json"))


def second_turn_of_prompt_1_hangs():
    """Prompt 1's episodes reach their second turn, whose generation never answers: the group goes stale mid-episode."""
    return ProgrammedGenerator(lambda r, a: Fate(hang=True) if r.prompt_id == 1 and r.request_id.endswith("-t1") else OK)


def test_stale_episodes_that_ignore_cancellation_are_abandoned_and_counted_never_failed():
    sim = simulate(env_recipe(12, ignore_cancel_prob=1.0), second_turn_of_prompt_1_hangs())
    counters = sim.collector.counters
    assert sim.result.outcome == "completed" and sim.result.steps == 12
    assert counters["rollout/stale_groups_total"] == 2  # prompt 1, taken twice (one requeue)
    assert sim.env_hosts is not None and sim.env_hosts.stopped == 0
    assert counters["env/abandoned_total"] == sim.env_hosts.abandoned >= 4  # both members of both takes, and at the end of the run
    assert counters["rollout/failed_total"] == counters["env/errors_total"] == 0
    turns = [r.completion.episode.turns for g in sim.trainer.trained_groups for r in g.rollouts]
    assert set(turns) == {4}  # done_prob 0: every trained episode ran to env.max_turns


def test_cooperative_episodes_stop_within_the_grace():
    sim = simulate(env_recipe(12, ignore_cancel_prob=0.0, stop_s={"dist": "const", "value": 0.1}), second_turn_of_prompt_1_hangs())
    assert sim.result.outcome == "completed"
    assert sim.collector.counters["rollout/stale_groups_total"] == 2
    # Each cancelled episode was told to stop (both members of both stale takes, and those in flight at the end of
    # the run) and stopped within env.cancel_grace_s: none abandoned.
    assert sim.env_hosts is not None and sim.env_hosts.stopped >= 4
    assert sim.collector.counters["env/abandoned_total"] == sim.env_hosts.abandoned == 0


def test_environment_errors_fail_their_rollouts_and_transient_ones_are_retried():
    sim = simulate(env_recipe(6, error_prob=0.05, transient_prob=0.05, done_prob=0.3))
    counters = sim.collector.counters
    assert counters["env/errors_total"] > 0 and counters["rollout/retries_total"] > 0 and counters["rollout/failed_total"] > 0
    assert counters["env/errors_total"] <= counters["rollout/failed_total"] + counters["rollout/retries_total"]
