"""tuning/fit.py (lengths: test_tuning_lengths.py), observe.compare and sweep's ranking: fits recover known parameters from synthetic records;
the tolerance and the recommendation rules hold at their edges."""

from __future__ import annotations

import math
import random

import pytest

from asyncgrpo.config import validate_config
from asyncgrpo.tuning.fit import (
    MIN_STEPS_PER_INDEX,
    concurrency_at_start,
    done_per_index,
    fit_decode,
    fit_env,
    fit_env_errors,
    fit_faults,
    fit_trainer,
    spread_within_cohorts,
)
from asyncgrpo.tuning.observe import Observed, compare
from asyncgrpo.tuning.sweep import KEYS, POLICIES, Point, candidates, frontier, policies_for, recommend


def test_environment_calls_give_a_lognormal_call_time_a_geometric_ending_and_a_binary_reward():
    rng = random.Random(2)
    calls, t = [], 0.0
    for episode in range(3000):
        duration = 0.05 * math.exp(0.5 * rng.gauss(0, 1))
        calls.append({"take": episode, "member": 0, "call": "reset", "start": t, "end": t + duration})
        for turn in range(1, 4):  # env.max_turns 3: an episode the cap ends counts its steps, not an ending
            done = rng.random() < 0.4
            calls.append({"take": episode, "member": 0, "call": "step", "start": t, "end": t + duration, "done": done,
                          "reward": float(rng.random() < 0.2), **({} if done or turn == 3 else {"tokens": 7})})
            if done:
                break
    fit = fit_env(calls)
    assert fit.call_median_s == pytest.approx(0.05, rel=0.05) and fit.call_sigma == pytest.approx(0.5, rel=0.05)
    assert fit.done_prob == pytest.approx(0.4, abs=0.02) and fit.reward_prob == pytest.approx(0.2, abs=0.02)
    assert fit.observation_tokens == 7 and len(fit.done_probs) == 3 and all(p == pytest.approx(0.4, abs=0.04) for p in fit.done_probs)
    other = [{**c, "reward": 0.5} if c["call"] == "step" else c for c in calls[:50]]
    assert fit_env(other).reward_prob is None  # not the 0-or-1 reward the simulated environment gives: not fitted


def test_the_chance_a_step_ends_its_episode_is_fitted_per_step_index_the_short_indices_pooled_into_the_last():
    """Episodes (take, member) whose first steps end 75 % of them, second 60 %, third 50 %; a reset (a retried episode) starts
    the count again. An index with fewer than MIN_STEPS_PER_INDEX steps pools with the indices after it into the entry before."""
    rng = random.Random(4)
    def episodes(n, probs):
        calls = []
        def line(take, call, **done):
            calls.append({"take": take, "member": 1, "call": call, "start": 0.0, "end": 0.1, **done})
        for take in range(n):
            line(take, "reset")
            if take % 10 == 0:  # a retried episode: its first try made one step, then failed; the retry resets
                line(take, "step", done=False)
                line(take, "reset")
            for p in probs:
                done = rng.random() < p
                line(take, "step", done=done)
                if done:
                    break
        return calls
    calls = episodes(1500, (0.75, 0.6, 0.5))
    head = [c for c in calls[:300] if c["call"] == "step"]
    fitted = done_per_index(calls)
    assert len(fitted) == 3 and fitted[0] == pytest.approx(0.75 * 1500 / (1500 + 150), abs=0.03)  # the retried tries' steps: index 0
    assert fitted[1] == pytest.approx(0.6, abs=0.05) and fitted[2] == pytest.approx(0.5, abs=0.08)
    assert fit_env(calls[:300]).done_prob == pytest.approx(sum(bool(c["done"]) for c in head) / len(head))  # pooled over every index
    def by_index(calls, index):  # (steps, ended) at `index`, counted here as the fit should
        counted, seen = [0, 0], {}
        for c in calls:
            seen[c["take"]] = -1 if c["call"] == "reset" else seen[c["take"]] + 1
            if c["call"] == "step" and seen[c["take"]] == index:
                counted = [counted[0] + 1, counted[1] + bool(c["done"])]
        return counted
    tail = episodes(400, (0.5, 0.9, 0.0))  # ~220 second steps, ~22 third: the third pools into the second's entry
    (n1, e1), (n2, e2) = by_index(tail, 1), by_index(tail, 2)
    assert n2 < MIN_STEPS_PER_INDEX <= n1 and done_per_index(tail)[1:] == ((e1 + e2) / (n1 + n2),)
    short = episodes(2 * MIN_STEPS_PER_INDEX, (0.9, 0.0))  # ~6 second steps: even index 1 is short, one entry pools them all
    steps = [c for c in short if c["call"] == "step"]
    assert done_per_index(short) == (sum(bool(c["done"]) for c in steps) / len(steps),) and done_per_index([]) == ()


def test_environment_errors_that_failed_a_rollout_are_told_from_the_retried_by_the_episode_lines_before_the_failure():
    """A line is written only for a call or turn that returned: a failed rollout whose last line is a turn (or that has none)
    failed in an environment call; one whose last line is an environment call failed generating (the generation's fault)."""
    def lines(take, *kinds):
        return [{"e": kind, "take": take, "member": 0, "start": float(i), "end": i + 0.5} for i, kind in enumerate(kinds)]
    rollouts = [{"take": take, "member": 0, "outcome": outcome} for take, outcome in
                [(0, "finished"), (1, "failed"), (2, "failed"), (3, "failed"), (4, "cancelled")]]
    episode = [*lines(0, "env", "turn", "env"), *lines(1, "env", "turn"), *lines(3, "env", "turn", "env"), *lines(4, "env")]
    fit = fit_env_errors(rollouts, episode, errors_total=5, recorded_share=1.0)  # 1: its step raised; 2: its reset; 3: generating
    assert (fit.failed, fit.retried) == (2, 3)
    assert fit.error_prob == pytest.approx(2 / (6 + 5)) and fit.transient_prob == pytest.approx(3 / (6 + 5))
    half = fit_env_errors(rollouts, episode, errors_total=5, recorded_share=0.5)  # the timeline kept half the run's rollouts
    assert (half.failed, half.retried) == (4, 1) and half.error_prob == pytest.approx(4 / (12 + 5))
    assert fit_env_errors(rollouts, episode, errors_total=0, recorded_share=1.0).error_prob == 0  # no error counted: none fitted


def test_calls_that_start_together_spread_only_around_their_cohort_which_an_engine_in_lock_step_slows_as_one():
    rng = random.Random(3)
    waves = [(wave * 2.0, rng.choice([0.1, 0.5])) for wave in range(40)]  # each wave's calls share its slowness
    times = [(start + 0.001 * i, slow + rng.gauss(0, 0.01)) for start, slow in waves for i in range(4)]
    assert spread_within_cohorts(times) == pytest.approx(0.01**2, rel=0.3)  # the waves' 0.1-or-0.5 is common to a cohort
    fit = fit_env([{"take": 0, "member": 0, "call": "step", "start": 0, "end": 1, "done": True, "reward": None}], times)
    assert fit.call_sigma < 0.05 and fit.call_median_s == pytest.approx(0.3, rel=0.2)
    assert spread_within_cohorts([(float(i), 1.0) for i in range(100)]) is None  # none started together: not enough to tell


def test_concurrency_counts_the_spans_open_at_each_start_itself_included():
    spans = [(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (2.5, 2.6)]
    assert concurrency_at_start(spans) == [1, 2, 2, 3]  # the first ended as the third started: not counted


def test_spans_starting_together_are_counted_in_the_given_order():
    spans = [(0.0, 5.0), (1.0, 2.0), (1.0, 3.0), (1.0, 4.0)]
    assert concurrency_at_start(spans) == [1, 2, 3, 4]
    assert concurrency_at_start(spans, order=[0, 3, 2, 1]) == [1, 4, 3, 2]


def _waves(prefill: float, per_token: float, knee: int) -> list[dict]:
    """Waves of 1..40 rollouts started together (each wave after the last ended), durations from the token model."""
    rng = random.Random(2)
    spans, t = [], 0.0
    for n in (1, 2, 3, 5, 8, 12, 16, 24, 32, 40):
        for i in range(n):
            tokens = rng.randint(20, 400)
            start = t + i * 1e-6
            spans.append({"start": start, "end": start + prefill + tokens * per_token * max(1, (i + 1) / knee),
                          "tokens": tokens, "outcome": "finished"})
        t = max(s["end"] for s in spans) + 1
    return spans


def test_decode_recovers_prefill_time_per_token_and_the_knee():
    fit = fit_decode(_waves(prefill=0.05, per_token=0.002, knee=8))
    assert fit.batch_knee == 8
    assert fit.prefill_s == pytest.approx(0.05, rel=1e-6)
    assert fit.decode_s_per_token == pytest.approx(0.002, rel=1e-6)
    assert fit.max_concurrency == 40


def test_decode_without_slowdown_puts_the_knee_at_the_most_seen_open():
    assert fit_decode(_waves(prefill=0.0, per_token=0.001, knee=10_000)).batch_knee == 40


def test_decode_counts_cancelled_rollouts_as_load_but_does_not_fit_them():
    spans = [{"start": 0.0, "end": 10.0, "tokens": 3, "outcome": "cancelled"},
             {"start": 1.0, "end": 1.2, "tokens": 100, "outcome": "finished"},
             {"start": 5.0, "end": 5.4, "tokens": 200, "outcome": "finished"}]
    fit = fit_decode(spans)
    assert fit.max_concurrency == 2 and fit.decode_s_per_token == pytest.approx(0.002 / max(1, 2 / fit.batch_knee))


def test_faults_reproduce_the_run_rates_by_kind():
    faults = fit_faults(finished=90, failed=5, cancelled=0, retries=5, takes=20, invalid_prompts=1)
    assert faults == [{"error": "http_500", "rate": 0.05}, {"error": "http_400", "rate": 0.05},
                      {"error": "prompt_too_long", "rate": 0.05}]
    assert fit_faults(finished=10, failed=0, cancelled=3, retries=0, takes=4, invalid_prompts=0) == []


def test_trainer_time_per_token_leaves_the_warm_up_step_out():
    fit = fit_trainer([(9.0, 100), (1.0, 1000), (2.0, 2000), (1.5, 1500)])
    assert fit.token_time_s == pytest.approx(0.001)
    assert fit.step_time_s == pytest.approx(1.5)
    assert fit.intercept_s == pytest.approx(0.0, abs=1e-12) and fit.slope_s == pytest.approx(0.001)
    assert fit.overhead_s == 0.0


def test_trainer_per_step_overhead_is_the_intercept_when_the_steps_show_one():
    rng = random.Random(0)
    steps = [(9.0, 100)] + [(0.5 + 0.001 * t + rng.gauss(0, 0.01), t) for t in (rng.randint(500, 2000) for _ in range(30))]
    fit = fit_trainer(steps)
    assert fit.overhead_s == pytest.approx(0.5, abs=0.05) and fit.token_time_s == pytest.approx(0.001, rel=0.05)
    rows = steps[1:]  # either way the fit reproduces the run's trainer time at its own step sizes
    assert sum(fit.overhead_s + fit.token_time_s * t for _, t in rows) == pytest.approx(sum(s for s, _ in rows))


@pytest.mark.parametrize("spread", [0, 20])
def test_trainer_time_stays_proportional_when_steps_of_about_one_size_cannot_show_an_overhead(spread):
    """Equal steps (no spread) or a spread noise swamps: an intercept extrapolated from them would be a guess."""
    rng = random.Random(1)
    steps = [(0.3 + 0.001 * t + rng.gauss(0, 0.05), t) for t in (700 + rng.randint(0, spread) for _ in range(30))]
    fit = fit_trainer(steps)
    assert fit.overhead_s == 0.0
    assert fit.token_time_s == pytest.approx(sum(s for s, _ in steps[1:]) / sum(t for _, t in steps[1:]))


def test_decode_leaves_out_rollouts_that_overlap_an_evaluation():
    """The servers decoded the evaluation's requests meanwhile: those rollouts are slow for a reason the simulator
    models apart (simulate.eval_s), so fitting them would slow every simulated rollout."""
    spans = _waves(prefill=0.05, per_token=0.002, knee=8)
    end = max(s["end"] for s in spans)
    slowed = [{"start": end + 1, "end": end + 31, "tokens": 100, "outcome": "finished"}]
    assert fit_decode(spans + slowed, busy=[(end + 2, end + 7)]) == fit_decode(spans)
    assert fit_decode(spans + slowed) != fit_decode(spans)


def _observed(tps: float, wait: float = 0.1, bias: float | None = 1.0, staleness: dict[int, float] | None = None, waste: float = 0.0):
    return Observed(tps, wait, staleness if staleness is not None else {1: 1.0}, waste, bias, 10)


@pytest.mark.parametrize(("tps", "wait", "ok"), [(109, 0.14, True), (91, 0.06, True), (111, 0.1, False), (100, 0.16, False)])
def test_compare_refuses_beyond_ten_percent_of_tokens_per_s_or_five_points_of_wait(tps, wait, ok):
    result = compare(_observed(100, wait=0.1), _observed(tps, wait=wait))
    assert result.ok is ok
    assert bool(result.reasons) is not ok


def test_only_policies_the_runs_backend_accepts_are_swept():
    local = validate_config({}, "test").model_dump()
    ray = validate_config({"runtime": "ray"}, "test").model_dump()
    agent = validate_config({"env": {"factory": "agent:my_agent:play"}}, "test").model_dump()
    assert policies_for(local) == policies_for(ray) == POLICIES  # Ray's actors continue rollouts in place
    assert policies_for(agent) == tuple(p for p in POLICIES if p != "resume")  # an agent's episodes are not resumed
    configs = candidates(1, "patience", 128, 8, policies_for(agent))
    assert "resume" not in {c["rollout.on_stale"] for c in configs} and len(configs) == 4 * 4 * 3 + 2 * 4


def test_a_run_that_evaluates_keeps_its_evaluations_per_trained_group_when_the_step_size_changes():
    """Else doubling groups_per_step would look faster only by evaluating half as often."""
    configs = candidates(1, "patience", 128, 8, eval_every=10)
    by_size = {c["rollout.groups_per_step"]: c.get("eval.every_steps") for c in configs}
    assert by_size == {4: 20, 8: None, 16: 5}
    assert all("eval.every_steps" not in c for c in candidates(1, "patience", 128, 8))


def test_candidates_start_with_the_run_and_cover_every_policy_without_duplicates():
    configs = candidates(1, "patience", 128, 8)
    assert configs[0] == dict(zip(KEYS, (1, "patience", 128, 8)))
    assert len(configs) == 4 * len(POLICIES) * 3 + 2 * len(POLICIES)  # the run's own config is one of them
    assert len({tuple(c.values()) for c in configs}) == len(configs)
    assert {c["rollout.on_stale"] for c in configs} == set(POLICIES)
    assert {c["rollout.max_staleness"] for c in configs} == {0, 1, 2, 3}


def _point(k: int, policy: str, tps: float, **kw) -> Point:
    return Point(dict(zip(KEYS, (k, policy, 64, 8))), _observed(tps, **kw), None, None)


def test_recommend_keeps_the_run_config_unless_another_is_faster_by_more_than_the_tolerance():
    base = _point(1, "patience", 100)
    assert recommend([base, _point(2, "drop", 109)], max_staleness=None, min_length_bias=None).changes == {}
    rec = recommend([base, _point(2, "drop", 120)], max_staleness=None, min_length_bias=None)
    assert rec.changes == {"rollout.max_staleness": 2, "rollout.on_stale": "drop"}
    assert "+20%" in rec.reason


def test_recommend_respects_the_staleness_and_length_bias_constraints():
    points = [_point(1, "patience", 100), _point(3, "drop", 200), _point(2, "requeue", 150, bias=0.9), _point(2, "wait", 130)]
    assert recommend(points, max_staleness=2, min_length_bias=0.95).changes == {"rollout.max_staleness": 2, "rollout.on_stale": "wait"}
    assert recommend(points, max_staleness=None, min_length_bias=None).changes["rollout.max_staleness"] == 3
    nothing = recommend(points, max_staleness=0, min_length_bias=None)
    assert nothing.changes == {} and "constraints" in nothing.reason


def test_a_run_outside_the_constraints_gets_the_fastest_config_inside_them_even_a_slower_one():
    points = [_point(1, "patience", 100), _point(0, "requeue", 80), _point(0, "drop", 70)]
    rec = recommend(points, max_staleness=0, min_length_bias=None)
    assert rec.changes == {"rollout.max_staleness": 0, "rollout.on_stale": "requeue"}
    assert "-20%" in rec.reason and "outside the constraints" in rec.reason


def test_frontier_drops_dominated_points_and_keeps_one_of_each_tie():
    run, tie = _point(1, "patience", 100), _point(1, "drop", 100)
    faster_but_biased, dominated = _point(2, "drop", 150, bias=0.8), _point(2, "requeue", 90)
    assert frontier([run, tie, faster_but_biased, dominated]) == [faster_but_biased, run]


def test_recommend_never_widens_generation_beyond_what_the_run_reached():
    """The decode model has no data beyond the widest concurrency the run saw (a real server timed out there)."""
    base = _point(1, "patience", 100)
    wider = Point({**base.overrides, "generation.max_inflight": 128}, _observed(150), None, None)
    assert recommend([base, wider], max_staleness=None, min_length_bias=None, widest=64).changes == {}
    assert recommend([base, wider], max_staleness=None, min_length_bias=None, widest=128).changes == {"generation.max_inflight": 128}
