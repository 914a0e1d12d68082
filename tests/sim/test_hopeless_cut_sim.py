"""`resume`'s early cut on virtual time: episodes whose early turns fall past the staleness bound are cut as stale once the
masked-share limit is out of reach (rollout/resumption.py `_hopeless`), instead of being played to their end and rejected.

The same run with the cut switched off (`ResumePolicy.hopeless` answering no, as before the cut) is the baseline: the cut
run wastes fewer tokens, trains every prompt the baseline trains, and keeps the chaos suite's invariants (generated =
trained + masked + wasted + held; the books; no trained token past its bound)."""

from __future__ import annotations

from unittest import mock

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import validate_config
from asyncgrpo.rollout.stale_policy import ResumePolicy, StalePolicy
from asyncgrpo.telemetry.timeline import Timeline
from tests.sim.test_chaos import check_books, check_outcome, check_token_bound
from tests.sim.test_episode_resume import env_recipe


def run():  # noqa: ANN201 (a Simulation and its timeline)
    # K = 1, steps of 0.2 s against 4 turns of 1 s and environment calls of up to 1 s, groups over-admitted by 4, 12 prompts
    # played to the end of the data; each episode is 128 model tokens and 12 of the environment's: env.max_tokens 140.
    cfg = env_recipe(max_staleness=1, over_admit_groups=4, max_masked_share=0.5).model_dump(mode="json")
    cfg["simulate"]["step_time_s"] = 0.2
    cfg["env"]["max_tokens"] = 140
    cfg["data"]["builtin_size"] = 12
    cfg["run"]["seed"] = 1
    cfg["train"]["max_steps"] = 12
    config = validate_config(cfg)
    timeline = Timeline(None, server="scripted", max_inflight=config.generation.max_inflight, group_size=config.rollout.group_size,
                        max_rollout_spans=0)
    return simulate(config, observer=timeline), timeline


def trained_prompts(sim) -> set[int]:  # noqa: ANN001
    return {group.prompt.id for record in sim.records for group in record.batch}


def test_resume_cuts_hopeless_episodes_early_wasting_fewer_tokens_and_training_every_prompt_it_trained_before() -> None:
    with mock.patch.object(ResumePolicy, "hopeless", StalePolicy.hopeless):  # the cut switched off: as before it
        before, _ = run()
    cut, timeline = run()
    check_outcome(cut)
    check_books(cut, timeline)
    check_token_bound(cut)
    was, now = before.collector.counters, cut.collector.counters
    assert was["rollout/masked_stale_tokens_total"] > 0 and was["rollout/stale_groups_total"] > 0  # rejected at their end before
    assert now["rollout/wasted_tokens_total"] < was["rollout/wasted_tokens_total"], (now, was)
    assert trained_prompts(cut) >= trained_prompts(before)
    assert now["rollout/trained_tokens_total"] >= was["rollout/trained_tokens_total"]
