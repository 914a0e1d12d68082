"""Episodes against the stall bound, on virtual time: an episode's turn is progress, so episodes longer than
`rollout.stall_timeout_s` that keep making turns are not a stall (the derived bound covers one turn, not
env.max_turns of them); a step past env.step_timeout_s fails its rollout."""

from __future__ import annotations

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import validate_config
from tests.sim.fakes import recipe


def env_recipe(step_s: float, stall_timeout_s: float, **env: object):
    base = recipe(
        env={"factory": "simulated:env", "max_turns": 10, "max_tokens": 4096, "cancel_grace_s": 0.5, **env},
        generation={"max_inflight": 16, "request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0},
        rollout={"group_size": 2, "groups_per_step": 1, "max_staleness": 1, "stall_timeout_s": stall_timeout_s},
        reward={"functions": []},
        train={"backend": "stub", "max_steps": 3},
        simulate={"step_time_s": 1.0, "env": {"call_s": {"dist": "const", "value": step_s}, "done_prob": 0.0}},
    )
    return validate_config(base.model_dump(mode="json"))


def test_episodes_that_keep_making_turns_are_not_a_stall():
    sim = simulate(env_recipe(step_s=30.0, stall_timeout_s=100.0))
    assert sim.result.outcome == "completed" and sim.result.steps == 3
    turns = {r.completion.episode.turns for g in sim.trainer.trained_groups for r in g.rollouts}
    assert turns == {10}  # each episode spent 10 x 30 s in its steps, three times the stall bound


def test_steps_past_env_step_timeout_fail_their_rollouts_naming_the_environment():
    sim = simulate(env_recipe(step_s=30.0, stall_timeout_s=1000.0, step_timeout_s=10.0))
    assert sim.result.outcome == "failed" and sim.result.steps == 0
    assert "env.step_timeout_s = 10" in str(sim.result.error) and "simulated:env" in str(sim.result.error)
    assert sim.collector.counters["env/errors_total"] == sim.collector.counters["rollout/failed_total"] >= 2
