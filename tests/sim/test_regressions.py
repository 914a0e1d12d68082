"""Named regressions: each one hangs, loses a prompt or miscounts on a naive implementation.

All run on virtual time with a hand-written generator whose every request fate the test
decides (tests/sim/fakes.py); prompts are taken in order 0, 1, 2, ...
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.commands.vtime import run_virtual
from asyncgrpo.errors import GenerationError, PipelineError, TransientGenerationError
from asyncgrpo.pipeline import run_pipeline
from tests.sim.fakes import OK, Fate, ProgrammedGenerator, make_collector, member, recipe

REFUSED = Fate(after_s=0.1, error=TransientGenerationError("connection refused", backend="programmed"))


def test_a_failure_after_the_trainer_reached_its_target_is_gap_filled_at_once():
    # K=1, one group per step. Prompt 1 (generated at version 0, so trainable up to step 1) keeps
    # getting refused until its rollout deadline, which passes while the trainer waits at step 1
    # for prompt 2 (slow, due at t=9). Dropping prompt 1 frees its place: the refill (prompt 3) must
    # start at that very instant, not at the next unrelated event (a lost wake-up after the drop
    # starts it only when prompt 2 finishes).
    cfg = recipe(
        rollout={"max_generation_failures": 1},
        generation={"request_timeout_s": 7.5, "rollout_deadline_s": 8.0},
        train={"max_steps": 6},
    )
    slow = Fate(after_s=7.0)
    gen = ProgrammedGenerator(lambda r, a: OK if r.prompt_id == 0 else REFUSED if r.prompt_id == 1 else slow)
    sim = simulate(cfg, gen)
    assert sim.result.outcome == "completed" and sim.result.steps == 6
    assert sim.collector.accounting.dropped["failed"] == 1
    trained = [g.prompt.id for g in sim.trainer.trained_groups]
    assert 1 not in trained and len(trained) == 6
    failed_at = max(gen.finished_at["1-0-0-0"], gen.finished_at["1-0-0-1"])
    step_1_waited_from = sim.records[0].wait_s + sim.records[0].step_s + sim.records[0].weight_sync_s
    assert step_1_waited_from < failed_at < step_1_waited_from + sim.records[1].wait_s  # the trainer was waiting
    assert gen.started_at["3-0-0-0"] == failed_at  # the gap was filled at once


def test_dead_generation_with_tolerance_3_fails_on_the_4th_consecutive_failure():
    cfg = recipe(rollout={"max_generation_failures": 3, "max_drop_fraction": 1.0}, generation={"request_timeout_s": 2.0, "rollout_deadline_s": 5.0})
    sim = simulate(cfg, ProgrammedGenerator(lambda r, a: REFUSED))
    assert sim.result.outcome == "failed"
    d = sim.result.diagnostic
    assert d.kind == "generation_failures" and d.count == 4 and d.threshold == 3
    assert sim.collector.accounting.dropped["failed"] == 4
    assert sim.virtual_time_s < 60  # the deadlines bound it; it never waits for a batch forever


def test_tolerance_0_first_all_failed_group_fails_the_run_with_the_full_diagnostic():
    boom = GenerationError("HTTP 400: bad sampling parameter", backend="programmed")
    cfg = recipe(rollout={"max_generation_failures": 0})
    sim = simulate(cfg, ProgrammedGenerator(lambda r, a: Fate(after_s=0.5, error=boom) if r.prompt_id == 0 else OK))
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "generation_failures"
    assert d.count == 1 and d.threshold == 0
    assert d.backend == "programmed" and d.generation_version == 0 and d.trainer_step == 0
    assert d.original is boom
    assert "HTTP 400: bad sampling parameter" in d.traceback and "Traceback" in d.traceback
    assert sim.result.steps == 0


def test_a_version_advance_while_the_collector_waits_is_not_lost():
    # K=0: after each step nothing may be admitted until the new weights are served. The only
    # wake-up for admission is the serving version changing during a slow weight sync; a lost
    # wake-up would leave the trainer waiting until the stall deadline.
    cfg = recipe(rollout={"max_staleness": 0, "stall_timeout_s": 30.0}, train={"max_steps": 25})
    gen = ProgrammedGenerator(weight_sync_s=0.7)
    sim = simulate(cfg, gen)
    assert sim.result.outcome == "completed" and sim.result.steps == 25
    assert sim.result.staleness_max == 0


def test_end_of_data_trains_the_groups_still_in_flight_and_counts_no_failure():
    cfg = recipe(data={"builtin_size": 5}, rollout={"groups_per_step": 2, "max_staleness": 2}, train={"max_steps": 100})
    sim = simulate(cfg, ProgrammedGenerator(lambda r, a: Fate(after_s=1.0 + r.prompt_id)))
    acc = sim.collector.accounting
    assert sim.result.outcome == "completed" and sim.result.stop_reason == "data_exhausted"
    assert acc.trained == 5 and acc.in_flight == 0 and acc.buffered == 0
    assert sum(acc.dropped.values()) == 0 and sim.collector.counters["rollout/failed_total"] == 0
    assert [len(r.batch) for r in sim.records] == [2, 2, 1]  # the last partial batch is trained


def test_success_resets_the_failure_streak():
    # One group at a time (max_inflight = group_size); prompts 0, 1 and 3 fail completely, 2 succeeds.
    failing = {0, 1, 3}
    crash = RuntimeError("worker crashed")
    cfg = recipe(rollout={"max_generation_failures": 2, "max_drop_fraction": 1.0}, generation={"max_inflight": 2})
    sim = simulate(cfg, ProgrammedGenerator(lambda r, a: Fate(after_s=0.2, error=crash) if r.prompt_id in failing else OK))
    assert sim.result.outcome == "completed", sim.result.diagnostic
    assert sim.collector.accounting.dropped["failed"] == 3


class FailingTogether(ProgrammedGenerator):
    """Every request waits for one shared moment (t = 0.1), then raises its prompt's error. A future's
    waiters resume in the order they began waiting, so the groups end in prompt order, within one pass
    of the loop: the later failures reach the policy after the first one failed the run, before any
    shutdown could cancel them."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        super().__init__()
        self.errors = errors
        self._moment: asyncio.Future[None] | None = None

    async def generate(self, request):
        loop = asyncio.get_running_loop()
        if self._moment is None:
            self._moment = loop.create_future()
            loop.call_later(0.1, self._moment.set_result, None)
        await self._moment
        raise self.errors[request.prompt_id]


def test_the_diagnostic_stays_the_first_and_each_check_raises_a_fresh_exception():
    first = GenerationError("first cause", backend="programmed")
    later = RuntimeError("later")
    cfg = recipe(rollout={"max_generation_failures": 0, "max_staleness": 1, "groups_per_step": 1})  # prompts 0 and 1 in flight
    sim = simulate(cfg, FailingTogether({0: first, 1: later}))
    # Both groups failed and were recorded: the second broke the budget again, after the first had.
    assert sim.collector.accounting.dropped["failed"] == 2 and sim.collector.books.policy.streak == 2
    errors = []
    for _ in range(2):
        with pytest.raises(PipelineError) as info:
            sim.collector.raise_if_failed()
        errors.append(info.value)
    assert errors[0] is not errors[1]
    for error in errors:
        assert error.diagnostic is sim.result.diagnostic
        assert error.__cause__ is first
        assert error.__traceback__ is not None
    assert sim.result.diagnostic.count == 1 and "first cause" in sim.result.diagnostic.traceback


def test_a_stale_in_flight_group_is_cancelled_its_requests_aborted_and_its_prompt_requeued():
    # Prompt 1's requests never answer (and never time out). Once the trainer moves past every
    # step that could still train it, the group is cancelled and its prompt requeued, until
    # max_requeues is spent; then it is dropped as stale. Nothing counts as a failure.
    cfg = recipe(
        generation={"request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0},
        rollout={"max_requeues": 1},
        train={"max_steps": 12},
    )
    gen = ProgrammedGenerator(lambda r, a: Fate(hang=True) if r.prompt_id == 1 else OK)
    sim = simulate(cfg, gen)
    counters, acc = sim.collector.counters, sim.collector.accounting
    assert sim.result.outcome == "completed"
    assert counters["rollout/stale_groups_total"] == 2
    assert counters["rollout/requeued_total"] == 1 and acc.requeued == 1
    assert acc.dropped["stale"] == 1
    aborted_for_prompt_1 = sorted(r for r in gen.aborted if r.startswith("1-"))
    assert aborted_for_prompt_1 == ["1-0-0-0", "1-0-0-1", "1-0-1-0", "1-0-1-1"]  # both takes, both members
    assert counters["rollout/failed_total"] == 0 and gen.in_progress == 0


def test_a_group_cancelled_while_only_partly_dispatched_never_strands():
    # One request slot, groups of 3: at max_steps the next group holds the slot with one
    # member, the others wait for it. Shutdown cancels it; nothing is left open or running.
    cfg = recipe(generation={"max_inflight": 1}, rollout={"group_size": 3, "max_staleness": 2}, train={"max_steps": 2})
    gen = ProgrammedGenerator()
    sim = simulate(cfg, gen)
    assert sim.result.outcome == "completed" and sim.result.steps == 2
    assert sim.collector.open_requests == 0 and gen.in_progress == 0
    assert sim.collector.accounting.in_flight == sim.collector.in_flight_groups >= 1
    assert sim.collector.counters["rollout/failed_total"] == 0


def test_a_group_with_one_survivor_is_dropped():
    crash = RuntimeError("boom")
    cfg = recipe(rollout={"group_size": 3, "min_group_survivors": 2, "max_drop_fraction": 1.0})
    gen = ProgrammedGenerator(lambda r, a: Fate(after_s=0.3, error=crash) if r.prompt_id == 0 and member(r) > 0 else OK)
    sim = simulate(cfg, gen)
    acc = sim.collector.accounting
    assert acc.dropped["too_few_survivors"] == 1 and acc.dropped["failed"] == 0
    assert sim.collector.counters["rollout/failed_total"] == 2
    assert sim.result.outcome == "completed"


def test_a_hung_request_ends_at_its_deadline():
    # Staleness 4 and slow steps keep the group trainable past its deadline, so only the deadline ends it.
    cfg = recipe(
        generation={"request_timeout_s": 4.0, "rollout_deadline_s": 10.0},
        rollout={"group_size": 3, "max_staleness": 4},
        train={"max_steps": 3}, simulate={"step_time_s": 5.0},
    )
    gen = ProgrammedGenerator(lambda r, a: Fate(hang=True) if r.request_id == "0-0-0-0" else OK)
    sim = simulate(cfg, gen)
    assert sim.result.outcome == "completed"
    assert sim.collector.counters["rollout/failed_total"] == 1
    assert gen.attempts["0-0-0-0"] >= 2  # each attempt ended at the request timeout and was retried
    assert gen.finished_at["0-0-0-0"] <= 10.0  # ... until the rollout deadline
    finished = {g.prompt.id: g for g in sim.trainer.trained_groups + sim.collector.batches.buffer.groups()}
    assert len(finished[0].rollouts) == 2 and finished[0].failed_rollouts == 1


def test_a_non_retryable_error_is_not_retried():
    bad = GenerationError("HTTP 400: unsupported parameter", backend="programmed")
    cfg = recipe(rollout={"group_size": 3})
    gen = ProgrammedGenerator(lambda r, a: Fate(after_s=0.1, error=bad) if r.request_id == "0-0-0-1" else OK)
    sim = simulate(cfg, gen)
    assert gen.attempts["0-0-0-1"] == 1
    assert sim.collector.counters["rollout/retries_total"] == 0
    assert sim.collector.counters["rollout/failed_total"] == 1


def test_shutdown_with_requests_in_flight_is_bounded_and_leaves_no_task_or_thread():
    from asyncgrpo.training.stub import StubTrainer

    cfg = recipe(generation={"request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0}, train={"max_steps": 50})
    gen = ProgrammedGenerator(lambda r, a: Fate(hang=True) if r.prompt_id >= 3 else OK)
    collector = make_collector(cfg, gen)
    threads_before = set(threading.enumerate())

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(run_pipeline(cfg, collector=collector, trainer=StubTrainer(1.0), generator=gen))
        await asyncio.sleep(20.0)  # requests of prompts >= 3 hang: the run is stuck waiting with work in flight
        assert gen.in_progress > 0
        task.cancel()  # what Ctrl-C / SIGTERM does
        cancelled_at = loop.time()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.time() - cancelled_at <= cfg.run.shutdown_timeout_s
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run_virtual(main())
    assert gen.in_progress == 0 and collector.open_requests == 0
    assert collector.accounting.balanced() and collector.accounting.in_flight > 0
    assert set(threading.enumerate()) == threads_before


def test_a_failing_training_step_becomes_the_runs_diagnostic_not_a_raw_traceback():
    from asyncgrpo.training.stub import StubTrainer

    class Exploding(StubTrainer):
        async def train_step(self, groups):
            if len(self.trained_groups) >= 2:
                raise FloatingPointError("loss is nan")
            return await super().train_step(groups)

    cfg = recipe()
    sim = simulate(cfg, ProgrammedGenerator(), trainer=Exploding(cfg.simulate.step_time_s))
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "step_error" and d.trainer_step == 2
    assert isinstance(d.original, FloatingPointError) and "loss is nan" in d.traceback


def test_a_weight_sync_that_never_returns_ends_at_its_deadline():
    class StuckSync(ProgrammedGenerator):
        async def load_weights(self, state, version):
            if version == 2:
                await asyncio.get_running_loop().create_future()
            await super().load_weights(state, version)

    cfg = recipe(generation={"weight_sync_timeout_s": 50.0})
    sim = simulate(cfg, StuckSync())
    d = sim.result.diagnostic
    assert sim.result.outcome == "failed" and d.kind == "weight_sync" and d.trainer_step == 1
    assert sim.virtual_time_s < 50 + 30


def test_a_backend_that_raises_cancelled_error_by_itself_fails_that_rollout_only():
    def fate(request, attempt):
        return Fate(after_s=0.2, error=asyncio.CancelledError()) if request.request_id == "0-0-0-1" else OK

    cfg = recipe(rollout={"group_size": 3})
    sim = simulate(cfg, ProgrammedGenerator(fate))
    assert sim.result.outcome == "completed"
    assert sim.collector.counters["rollout/failed_total"] == 1
    finished = {g.prompt.id: g for g in sim.trainer.trained_groups + sim.collector.batches.buffer.groups()}
    assert finished[0].failed_rollouts == 1 and len(finished[0].rollouts) == 2


def test_a_slow_reward_is_progress_not_a_stall():
    # Every group's reward takes 200 s (within reward.timeout_s); the derived stall deadline allows it.
    cfg = recipe(
        reward={"functions": ["tests.sim.test_regressions:slow_reward"], "timeout_s": 600.0},
        rollout={"stall_timeout_s": None},
        train={"max_steps": 3},
    )
    sim = simulate(cfg, ProgrammedGenerator())
    assert sim.result.outcome == "completed", sim.result.diagnostic


async def slow_reward(prompts, completions, **columns):
    await asyncio.sleep(200.0)
    return [float(len(c) % 2) for c in completions]


def test_a_pipeline_with_nothing_moving_raises_stall_error_naming_what_it_waited_for():
    # Every request hangs and the deadlines are (misconfigured to be) longer than the stall bound.
    cfg = recipe(
        generation={"request_timeout_s": 1000.0, "rollout_deadline_s": 1000.0},
        rollout={"stall_timeout_s": 50.0, "groups_per_step": 2},
    )
    sim = simulate(cfg, ProgrammedGenerator(lambda r, a: Fate(hang=True)))
    d = sim.result.diagnostic
    assert sim.result.outcome == "stalled" and sim.exit_code == 2 and d.kind == "stall"
    assert "step 0 waited for 2 groups" in d.message and "requests open" in d.message
    assert 50 <= sim.virtual_time_s < 60


def test_tolerated_failures_are_logged_first_in_full_then_summarised_on_virtual_time(caplog):
    # Every first attempt is refused (retried), and prompt 2's rollouts crash (failed, not retried).
    crash = RuntimeError("worker crashed")
    cfg = recipe(logging={"failure_summary_s": 5.0}, rollout={"max_drop_fraction": 1.0, "max_generation_failures": 5}, train={"max_steps": 20})

    def fate(request, attempt):
        if request.prompt_id == 2:
            return Fate(after_s=0.2, error=crash)
        return REFUSED if attempt == 1 else OK

    with caplog.at_level("WARNING", logger="asyncgrpo"):
        sim = simulate(cfg, ProgrammedGenerator(fate))
    assert sim.result.outcome == "completed"
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncgrpo"]
    full = [line for line in lines if line.startswith("tolerated failure (")]
    assert len(full) == 2
    assert "attempt retried): TransientGenerationError from programmed: connection refused" in full[0]
    assert "rollout failed): RuntimeError from programmed: worker crashed" in full[1]
    summaries = [line for line in lines if line.startswith("tolerated failures in the last")]
    # at most one summary per 5 virtual seconds, and every counted failure appears in one of them
    assert 2 <= len(summaries) <= sim.virtual_time_s / 5 + 1
    def total(what):
        return sum(int(s.split(f" x {what}")[0].rsplit(" ", 1)[1]) for s in summaries if f" x {what}" in s)

    assert total("attempt retried") == sim.collector.counters["rollout/retries_total"] > 10
    assert total("rollout failed") == sim.collector.counters["rollout/failed_total"] == 2


@pytest.mark.timeout(60)  # a hang guard: without the fix the loop spins forever once virtual time passes 2**24 s
def test_a_simulation_of_million_second_steps_finishes():
    sim = simulate(recipe(train={"max_steps": 20}, simulate={"step_time_s": 1e6}))
    assert sim.result.outcome == "completed" and sim.result.steps == 20
    assert sim.virtual_time_s >= 2e7


async def late_partial_reward(prompts, completions, **columns):
    """Prompt 1's group takes 5 s to score and its third completion gets no score; every other group is scored at once."""
    if not completions[0].startswith("1-"):
        return [float(len(c) % 2) for c in completions]
    await asyncio.sleep(5.0)
    return [None if c.endswith("-2") else 1.0 for c in completions]


def test_a_group_judged_stale_counts_its_unscored_tokens_once():
    # Prompt 1's group is scored (two of its three completions) only after the trainer has moved past its bound. Under
    # `resume` with `max_masked_share` 1 a finished group is not cancelled for that (its tokens may all be masked), and it is
    # stale when judged: every finished token of it is wasted once, as stale, not its unscored completion also as failed.
    from tests.sim.test_chaos import check_tokens

    cfg = recipe(
        reward={"functions": ["tests.sim.test_regressions:late_partial_reward"], "timeout_s": 600.0},
        rollout={"group_size": 3, "min_group_survivors": 2, "on_stale": "resume", "max_masked_share": 1.0},
        train={"max_steps": 6},
    )
    sim = simulate(cfg, ProgrammedGenerator())
    counters = sim.collector.counters
    assert sim.result.outcome == "completed", sim.result.diagnostic
    assert 1 not in [g.prompt.id for g in sim.trainer.trained_groups] and counters["rollout/stale_groups_total"] >= 1
    assert counters["rollout/wasted_tokens/failed"] == 0, counters
    check_tokens(sim)
