"""A run whose reward misbehaves ends with a diagnostic that names the reward function."""

from __future__ import annotations

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.rewards.scoring import UnscoredGroupError
from tests.sim.fakes import ProgrammedGenerator, recipe


def no_opinion(prompts, completions, **columns):
    """A judge that can never decide: None ("no score") for every completion."""
    return [None] * len(completions)


def test_a_reward_returning_none_for_everything_is_named_in_the_diagnostic():
    cfg = recipe(
        reward={"functions": ["tests.sim.test_reward_diagnostics:no_opinion"]},
        rollout={"drop_window": 4, "max_drop_fraction": 0.5},
    )
    sim = simulate(cfg, ProgrammedGenerator())
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "drop_fraction"
    assert d.details["by_reason"] == {"too_few_survivors": 4}
    assert isinstance(d.original, UnscoredGroupError)
    rendered = d.render()
    assert "fix the cause below" in rendered
    assert "'no_opinion' returned None for all 2 completions" in rendered and "None means no score (TRL's semantics)" in rendered
