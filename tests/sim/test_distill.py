"""`algorithm: distill` on virtual time: each sample is its own unit of staleness and accounting, and the
teacher is a stage that can fail (the failure policy, never a 0.0) and stall (the diagnostic names it).

A hand-written generator decides every request's fate (tests/sim/fakes.py); prompts are taken in order."""

from __future__ import annotations

from asyncgrpo.commands.simulate import simulate
from tests.sim.fakes import OK, Fate, ProgrammedGenerator, recipe


def distill_recipe(**sections):
    defaults = {
        "rollout": {"group_size": 1, "min_group_survivors": 1, "groups_per_step": 2, "max_staleness": 0, "stall_timeout_s": 600.0},
        "distill": {},
        "simulate": {"teacher_latency_s": {"dist": "const", "value": 0.1}},
    }
    merged = {name: {**defaults.get(name, {}), **sections.get(name, {})} for name in {*defaults, *sections}}
    return recipe(**merged)


def test_in_flight_samples_past_the_bound_are_cancelled_one_by_one_and_counted():
    # K = 1, two samples per step. Prompts 2 and 5 are slow (20 s): every other sample is done in 1 s, so the
    # steps move on without them and each is cancelled in flight, alone, once no remaining step can train it.
    cfg = distill_recipe(rollout={"on_stale": "drop", "max_staleness": 1}, train={"max_steps": 6},
                         generation={"request_timeout_s": 60.0, "rollout_deadline_s": 120.0})
    slow = {2, 5}
    gen = ProgrammedGenerator(lambda r, a: Fate(after_s=20.0) if r.prompt_id in slow else OK)
    sim = simulate(cfg, gen)
    acc, counters = sim.collector.accounting, sim.collector.counters
    assert sim.result.outcome == "completed" and sim.result.steps == 6
    assert {"2-0-0-0", "5-0-0-0"} <= set(gen.aborted) and not {"2-0-0-0", "5-0-0-0"} & set(gen.completed)
    assert counters["rollout/stale_groups_total"] == counters["rollout/stale_samples_total"] == 2  # one sample each
    assert acc.dropped["stale"] == 2 and counters["rollout/wasted_tokens_total"] == 0  # cancelled before finishing
    assert acc.taken == acc.trained + acc.requeued + sum(acc.dropped.values()) + acc.in_flight + acc.buffered
    assert all(len(g.rollouts) == 1 and g.rollouts[0].teacher_logprobs is not None for g in sim.trainer.trained_groups)
    assert not {2, 5} & {g.prompt.id for g in sim.trainer.trained_groups}


def test_a_teacher_error_fails_the_run_with_its_diagnostic():
    cfg = distill_recipe(simulate={"teacher_error_rate": 1.0})
    sim = simulate(cfg, ProgrammedGenerator())
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and sim.result.steps == 0 and d is not None
    assert d.kind == "teacher_error" and "injected fault" in d.message and "distill.on_error: drop" in d.message
    assert sim.trainer.trained_groups == [] and sim.collector.accounting.dropped["reward_error"] >= 1


def test_teacher_errors_under_on_error_drop_are_counted_drops_under_the_failure_policy():
    cfg = distill_recipe(distill={"on_error": "drop"}, simulate={"teacher_error_rate": 0.3}, rollout={"max_drop_fraction": 1.0},
                         train={"max_steps": 10})
    sim = simulate(cfg, ProgrammedGenerator())
    acc = sim.collector.accounting
    assert sim.result.outcome == "completed" and sim.result.steps == 10
    assert acc.dropped["reward_error"] > 0 and sim.collector.counters["rollout/dropped/reward_error"] == acc.dropped["reward_error"]
    # What trained was scored by the teacher: nothing stands in for a missing score.
    assert all(r.teacher_logprobs is not None and len(r.teacher_logprobs) == 4 for g in sim.trainer.trained_groups for r in g.rollouts)
    # The same drops break the drop-fraction rule when it is on: the window of 4 has more than half dropped.
    cfg = distill_recipe(distill={"on_error": "drop"}, simulate={"teacher_error_rate": 0.7},
                         rollout={"max_drop_fraction": 0.5, "drop_window": 4}, train={"max_steps": 10})
    sim = simulate(cfg, ProgrammedGenerator())
    assert sim.result.outcome == "failed" and sim.result.diagnostic.kind == "drop_fraction"
    assert "reward_error" in sim.result.diagnostic.details["by_reason"]


def test_a_teacher_that_never_answers_is_a_stall_that_names_the_teacher():
    cfg = distill_recipe(distill={"timeout_s": 5_000.0}, simulate={"teacher_latency_s": {"dist": "const", "value": 10_000.0}},
                         rollout={"stall_timeout_s": 50.0})
    sim = simulate(cfg, ProgrammedGenerator())
    d = sim.result.diagnostic
    assert sim.result.outcome == "stalled" and d.kind == "stall"
    assert "2 being scored by the teacher (teacher simulated-teacher: 2 calls being scored" in d.message, d.message
    # A teacher slower than distill.timeout_s is a timeout of that sample instead, through the failure policy.
    cfg = distill_recipe(distill={"timeout_s": 5.0}, simulate={"teacher_latency_s": {"dist": "const", "value": 10_000.0}})
    sim = simulate(cfg, ProgrammedGenerator())
    assert sim.result.diagnostic.kind == "teacher_error" and "within distill.timeout_s = 5 s" in sim.result.diagnostic.message


def test_simulate_reports_the_distillation_kl_every_step(tmp_path):
    import json

    cfg = distill_recipe(train={"max_steps": 3})
    sim = simulate(cfg, ProgrammedGenerator(), output_dir=tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sim.result.steps == 3 and len(lines) == 3
    assert all(line["distill/kl_mean"] > 0 and line["reward/mean"] < 0 for line in lines)


def test_stale_len_mean_is_over_finished_completions_not_the_samples_cancelled_in_flight(tmp_path):
    """Under distill a sample cancelled in flight is a stale sample with no tokens: it must not pull the mean
    length of the finished stale completions towards 0 (issue 20, item 7: it read 0.098 beside 13.7 trained)."""
    from asyncgrpo.telemetry.metrics import read_jsonl

    cfg = distill_recipe(rollout={"on_stale": "drop", "max_staleness": 1}, train={"max_steps": 6},
                         generation={"request_timeout_s": 60.0, "rollout_deadline_s": 120.0})
    gen = ProgrammedGenerator(lambda r, a: Fate(after_s=20.0) if r.prompt_id in {2, 5} else OK)
    sim = simulate(cfg, gen, output_dir=tmp_path)
    counters = sim.collector.counters
    assert counters["rollout/stale_samples_total"] == 2 and counters["rollout/stale_completions_total"] == 0
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert last["rollout/stale_len_mean"] is None  # no finished completion was thrown away: no mean, not 0
    assert last["rollout/trained_len_mean"] > 0
