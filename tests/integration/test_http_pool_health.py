"""`HttpGenerator` against servers that answer /health but fail or hang every completion (real HTTP servers).

- Every request answered with HTTP 500, or its connection reset: training and evaluation end with
  `backend_dead` after `generation.backend_dead_after_s`, naming the server and its last error (not
  after each request's `rollout_deadline_s`, which these tests set far beyond the test's own bound).
- One of two servers hangs every request: it is taken out of rotation after a few attempt timeouts,
  probed back in once it answers again, and both transitions are logged.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncgrpo.errors import BackendDeadError, TransientGenerationError
from asyncgrpo.evaluation import evaluate
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.pool_health import HUNG_AFTER
from asyncgrpo.pipeline import run_pipeline
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.training.stub import StubTrainer
from tests.integration.servers import FakeServer, until
from tests.integration.test_http_generator import learn_latencies, make_collector, recipe, request, run, tiny_prompts

pytestmark = pytest.mark.timeout(120)

FAILURES = {"500": ((500, {"error": {"message": "engine crashed"}}), "engine crashed"),
            "reset": ("reset", "Connection reset")}
NEVER_S = 600.0  # a rollout deadline the test's own bound (run(): 60 s) never reaches


def failing_recipe(url: str):
    return recipe([url], generation={"backend_dead_after_s": 1.0, "request_timeout_s": 10.0, "rollout_deadline_s": NEVER_S,
                                     "retry_backoff_s": 0.05, "retry_backoff_max_s": 0.2},
                  rollout={"stall_timeout_s": 2 * NEVER_S})


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_server_that_fails_every_request_ends_training_as_backend_dead_naming_it(failure, caplog):
    answer, words = FAILURES[failure]
    caplog.set_level(logging.WARNING, logger="asyncgrpo")

    async def main():
        fake = await FakeServer().start()
        fake.completion = answer
        cfg = failing_recipe(fake.url)
        gen = HttpGenerator(cfg.generation)
        collector = make_collector(cfg, gen, tiny_prompts(8))
        await gen.start()
        try:
            return await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen), fake
        finally:
            await gen.aclose()
            await fake.stop()

    result, fake = run(main(), timeout_s=60)
    d = result.diagnostic
    assert result.outcome == "failed" and d.kind == "backend_dead", d
    assert isinstance(d.original, BackendDeadError)
    assert fake.url in d.message and words in d.message and "generation.backend_dead_after_s = 1" in d.message
    assert fake.started > 1  # retried until the backend counted as dead, not given up at the first failure
    # A reset marks the server unhealthy and its /health brings it back at once: said once, not per request.
    flaps = [r for r in caplog.records if r.levelno >= logging.WARNING and "is unhealthy" in r.getMessage()]
    assert len(flaps) <= 1 < fake.started


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_server_that_fails_every_request_ends_the_evaluation_as_backend_dead(failure):
    answer, words = FAILURES[failure]

    async def main():
        fake = await FakeServer().start()
        fake.completion = answer
        cfg = failing_recipe(fake.url)
        gen = HttpGenerator(cfg.generation)
        scorer = RewardScorer([("length", lambda completions, **_: [float(len(c)) for c in completions])], None, 30.0,
                              isolation="inline")
        await gen.start()
        try:
            with pytest.raises(BackendDeadError) as caught:
                await evaluate(cfg, gen, scorer, tiny_prompts(4), (2,), step=0)
            return caught.value, fake
        finally:
            await gen.aclose()
            await fake.stop()

    error, fake = run(main(), timeout_s=60)
    assert fake.url in str(error) and words in str(error) and "backend_dead_after_s" in str(error)


def test_answers_in_between_keep_failures_from_ending_the_run():
    """Only a stretch with no answer at all counts: a server failing every other request is alive."""
    async def main():
        fake = await FakeServer().start()
        fake.fault = lambda number, body: "500" if number % 2 else None
        cfg = failing_recipe(fake.url)
        gen = HttpGenerator(cfg.generation)
        collector = make_collector(cfg, gen, tiny_prompts(8))
        await gen.start()
        try:
            await asyncio.sleep(cfg.generation.backend_dead_after_s)  # the first failure comes after a quiet start
            return await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen)
        finally:
            await gen.aclose()
            await fake.stop()

    result = run(main(), timeout_s=60)
    assert result.outcome == "completed", result.diagnostic


def test_a_server_that_hangs_every_request_is_taken_out_of_rotation_and_probed_back_in(caplog):
    async def main():
        good, hung = await FakeServer().start(), await FakeServer().start()
        gen = HttpGenerator(recipe([good.url, hung.url], generation={"request_timeout_s": 60.0,
                                                                     "rollout_deadline_s": 120.0}).generation)
        await gen.start()

        async def answered(i):  # the collector's retries, without backoff
            while True:
                try:
                    return await gen.generate(request(i))
                except TransientGenerationError:
                    continue

        def work_sent(server):  # completion requests, not the one-token probes
            return sum(1 for body in server.requests if body["max_tokens"] != 1)

        try:
            await learn_latencies(gen)
            hung.completion = "hang"
            with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
                before = work_sent(hung)
                for batch in range(10):  # 4 at a time: the hung server's attempts are overtaken by the good one's answers
                    await asyncio.gather(*(answered(100 + 4 * batch + i) for i in range(4)))
                suspended = work_sent(hung) - before
                stats = gen.stats()
                hung.completion = "ok"
                await until(lambda: gen.stats()["servers"][1]["hung"] is None, 30, "the probe to bring the server back")
                answered_before = hung.answered
                await asyncio.gather(*(answered(200 + i) for i in range(16)))
            return suspended, stats, hung.answered - answered_before, gen.stats(), hung.url
        finally:
            await gen.aclose()
            await good.stop()
            await hung.stop()

    attempts_while_hung, stats_hung, answered_after, stats_after, url = run(main())
    assert stats_hung["servers"][1]["hung"] is not None and stats_hung["hung_suspensions"] == 1
    assert attempts_while_hung <= HUNG_AFTER + 4  # the streak, plus what was in flight when it was taken out
    assert stats_after["hung_returns"] == 1 and answered_after > 0  # back in rotation: it takes work again
    messages = [r.getMessage() for r in caplog.records]
    assert any(url in m and "out of rotation" in m for m in messages)
    assert any(url in m and "back in rotation" in m for m in messages)


def test_a_request_waiting_for_a_server_ends_when_the_attempts_have_failed_for_backend_dead_after_s():
    """Attempts failed (HTTP 500) for a while, then the server went down: the request waiting for a server
    raises once the failures reach backend_dead_after_s, not a full backend_dead_after_s after the server went
    down (failed probes of a server that stays down wake no waiter, so its deadline bounds the wait)."""
    dead_after_s = 3.0

    async def main():
        fake = await FakeServer().start()
        fake.completion = (500, {"error": {"message": "engine crashed"}})
        gen = HttpGenerator(recipe([fake.url], generation={"backend_dead_after_s": dead_after_s}).generation)
        await gen.start()
        pool = gen._pool
        loop = asyncio.get_running_loop()
        try:
            with pytest.raises(TransientGenerationError):
                await gen.generate(request(0))
            await asyncio.sleep(dead_after_s / 2)  # failing for half the limit, with the server up
            await fake.close_port(fake.url)
            while pool.none_usable_since is None:  # the probes see it down (interval 0.2 s)
                await asyncio.sleep(0.02)
            with pytest.raises(BackendDeadError) as caught:
                await gen.generate(request(1))
            return loop.time(), pool.health.failing_since, pool.none_usable_since, caught.value, fake.url
        finally:
            await gen.aclose()
            await fake.stop()

    raised_at, failing_since, none_usable_since, error, url = run(main(), timeout_s=60)
    assert failing_since + dead_after_s <= raised_at < none_usable_since + dead_after_s
    assert "of failing attempts" in str(error) and url in str(error)
