"""`HttpGenerator` against real `asyncgrpo serve` processes and in-process fake servers.

Real processes: generation and version stamps, weight publication through disk, a 400 that the
collector does not retry, cancellation reaching the server, and a server killed mid-run (restarted:
the run recovers; not restarted: the run fails with `backend_dead`). In-process fakes (on the test's
loop): a hung server, the error classes, failover between servers and a failed weight install.
Every wait is on an observable condition with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.config import validate_config
from asyncgrpo.data.loading import build_prompts, read_rows
from asyncgrpo.errors import (
    BackendDeadError,
    GenerationError,
    MisconfiguredBackendError,
    PromptRejectedError,
    RequestTimeoutError,
    TransientGenerationError,
)
from asyncgrpo.generation.attempt_timeout import MIN_SAMPLES
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.weight_sync import WeightSyncError
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.pipeline import run_pipeline
from asyncgrpo.rollout.collector import Collector
from asyncgrpo.training.stub import StubTrainer
from asyncgrpo.types import GenerationRequest, Prompt, SamplingParams
from asyncgrpo.wiring.collector import build_collector
from tests.bounded import run_bounded
from tests.integration.servers import FakeServer, ServeProcess, free_port, http, until

pytestmark = pytest.mark.timeout(120)

EOS = 2


def run(coro, timeout_s: float = 90.0):
    return run_bounded(coro, timeout_s)



def recipe(urls: list[str], **sections):
    base = {
        "run": {"name": "http-test", "seed": 0},
        "data": {"source": "builtin:repeat_letter", "builtin_size": 40, "shuffle": False},
        "reward": {"functions": ["builtin:repeat_letter"]},
        "generation": {"backend": "http", "max_new_tokens": 8, "health_probe_interval_s": 0.2,
                       "request_timeout_s": 10.0, "rollout_deadline_s": 30.0, "retry_backoff_s": 0.05,
                       "retry_backoff_max_s": 0.5, "backend_dead_after_s": 30.0,
                       "http": {"base_urls": urls, "startup_timeout_s": 60.0}},
        "rollout": {"group_size": 2, "groups_per_step": 2, "max_staleness": 1, "stall_timeout_s": 120.0},
        "train": {"backend": "stub", "max_steps": 4},
        "simulate": {"step_time_s": 0.01},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return validate_config(base)


def tiny_prompts(n: int = 40) -> list[Prompt]:
    prompts, _ = build_prompts(read_rows("builtin:repeat_letter", builtin_size=n, seed=0), prompt_key="prompt",
                               tokenizer=build_tiny(0)[1], max_prompt_tokens=256)
    return prompts


def make_collector(cfg, generator, prompts: list[Prompt]) -> Collector:
    return build_collector(cfg, prompts, generator, stop_token_ids=(EOS,), isolation="inline")


def request(rid: int = 0, prompt=(5, 6, 7), max_new_tokens: int = 6, **sampling) -> GenerationRequest:
    return GenerationRequest(f"r{rid}", rid, tuple(prompt), SamplingParams(max_new_tokens=max_new_tokens, **sampling),
                             seed=rid)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(*build_tiny(0), tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two `asyncgrpo serve` processes, started together: `main` for most tests, `crash` to be killed."""
    logs = tmp_path_factory.mktemp("logs")
    main = ServeProcess(model_dir, logs, extra=("--served-model-name", "tiny")).start()
    crash = ServeProcess(model_dir, logs, extra=("--served-model-name", "tiny")).start()
    try:
        main.wait_healthy()
        crash.wait_healthy()
        yield {"main": main, "crash": crash}
    finally:
        for proc in (main, crash):
            proc.kill()


# ----------------------------------------------------------------------------- real servers


def test_generate_stamps_the_serving_version_and_load_weights_publishes_through_disk(servers, model_dir, tmp_path):
    server = servers["main"]
    cfg = recipe([server.url]).generation

    async def main():
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights", model_config=model_dir)
        await gen.start()
        try:
            assert gen.model == "tiny" and gen.serving_version == 0
            first = await gen.generate(request(1, stop_token_ids=(EOS,)))
            assert first.versions == (0,) * len(first.token_ids) and first.dispatch_version == 0
            assert 1 <= len(first.token_ids) <= 6 and len(first.logprobs) == len(first.token_ids)
            for version in (1, 2, 3):
                await gen.load_weights(build_tiny(version)[0].state_dict(), version)
                assert gen.serving_version == version
                assert server.stats()["serving_version"] == version  # what the server itself reports
                later = await gen.generate(request(1, stop_token_ids=(EOS,)))
                assert later.versions == (version,) * len(later.token_ids) and later.dispatch_version == version
            assert gen.stats()["weight_sync_failures"] == 0
            await gen.load_weights(build_tiny(0)[0].state_dict(), 4)  # the original weights, for the next tests
            assert server.stats()["serving_version"] == 4
        finally:
            await gen.aclose()

    run(main())
    kept = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert kept == ["v000003", "v000004"]  # the last two versions only, no temp directories
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "v000003", local_files_only=True)
    for name, tensor in build_tiny(3)[0].state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_start_refuses_a_wrong_model_name_and_an_unreachable_server(servers):
    server = servers["main"]

    async def main():
        gen = HttpGenerator(recipe([server.url], generation={"http": {"base_urls": [server.url], "model": "nope"}}).generation)
        with pytest.raises(MisconfiguredBackendError) as wrong:
            await gen.start()
        await gen.aclose()
        nowhere = f"http://127.0.0.1:{free_port()}"
        gen = HttpGenerator(recipe([nowhere], generation={"http": {"base_urls": [nowhere], "startup_timeout_s": 0.5}}).generation)
        with pytest.raises(BackendDeadError) as dead:
            await gen.start()
        await gen.aclose()
        return wrong.value, dead.value

    wrong, dead = run(main())
    assert server.url in str(wrong) and "'nope'" in str(wrong) and "['tiny']" in str(wrong)
    assert wrong.kind == "misconfigured_backend"
    assert "127.0.0.1" in str(dead) and "startup_timeout_s" in str(dead) and dead.kind == "backend_dead"


def test_cancelling_generate_closes_the_request_and_the_server_aborts_it(servers):
    server = servers["main"]

    async def main():
        gen = HttpGenerator(recipe([server.url]).generation)
        await gen.start()
        base = server.stats()
        assert http("POST", f"{server.url}/pause?mode=keep")[0] == 200  # the request will be held at the server
        try:
            task = asyncio.create_task(gen.generate(request(2)))
            await until(lambda: server.stats()["requests_waiting"] == 1, 30, "the request to reach the server")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await until(lambda: (s := server.stats())["requests_aborted"] > base["requests_aborted"] and s,
                                30, "the server to see the request aborted")
            assert stats["requests_waiting"] == 0 and stats["requests_completed"] == base["requests_completed"]
            state = gen.stats()
            assert state["servers"][0]["healthy"] and state["servers"][0]["outstanding"] == 0
            assert state["unhealthy_marks"] == 0  # cancellation is not a failure
        finally:
            http("POST", f"{server.url}/resume")
            await gen.aclose()

    run(main())


def test_a_400_is_not_retried_and_a_too_long_prompt_is_an_invalid_prompt(servers):
    server = servers["main"]
    ok = tiny_prompts(8)
    too_long = Prompt(id=100, text="long", token_ids=(5,) * 505)  # 505 + 8 new tokens > 512
    out_of_vocab = Prompt(id=101, text="oov", token_ids=(5, 10_000))

    def run_once(prompts, **rollout):
        cfg = recipe([server.url], rollout=rollout, train={"max_steps": 100})
        gen = HttpGenerator(cfg.generation)
        collector = make_collector(cfg, gen, prompts)

        async def main():
            await gen.start()
            try:
                return await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen)
            finally:
                await gen.aclose()

        before = server.stats()["requests_rejected"]
        result = run(main())
        return result, collector, server.stats()["requests_rejected"] - before

    # Tolerant: both bad groups are dropped, each rollout was sent exactly once, the data runs out.
    result, collector, rejected = run_once([too_long, out_of_vocab, *ok], max_generation_failures=5, max_drop_fraction=1.0)
    assert result.outcome == "completed" and result.stop_reason == "data_exhausted", result.diagnostic
    assert collector.accounting.dropped["invalid_prompt"] == 1 and collector.accounting.dropped["failed"] == 1
    assert collector.counters["rollout/retries_total"] == 0 and rejected == 4
    assert collector.accounting.trained == len(ok)

    # Intolerant: the first all-failed group fails the run, with the server's message.
    result, collector, rejected = run_once([out_of_vocab, *ok], max_generation_failures=0)
    d = result.diagnostic
    assert result.outcome == "failed" and d.kind == "generation_failures"
    assert isinstance(d.original, GenerationError) and not isinstance(d.original, TransientGenerationError)
    assert "HTTP 400" in str(d.original) and "out of vocabulary" in str(d.original)
    assert rejected == 2 and collector.counters["rollout/retries_total"] == 0


class ThreadedTorchTrainer:
    """The real trainer, its steps on a worker thread (as run.py does)."""

    def __init__(self, model_dir: Path, cfg) -> None:
        from asyncgrpo.training.trainer import TorchTrainer

        model, tokenizer = load_model_and_tokenizer(str(model_dir))
        self.trainer = TorchTrainer(model, tokenizer, cfg)

    async def train_step(self, groups):
        return await asyncio.to_thread(self.trainer.train_step, groups)

    def generation_weights(self):
        return self.trainer.generation_weights()


def test_a_killed_server_restarted_on_the_same_port_gets_the_latest_weights_and_the_run_recovers(servers, model_dir, tmp_path):
    server = servers["crash"]
    cfg = recipe([server.url], train={"backend": "torch", "max_steps": 6},
                 generation={"backend_dead_after_s": 90.0, "request_timeout_s": 5.0, "rollout_deadline_s": 90.0})
    gen = HttpGenerator(cfg.generation, weights_dir=tmp_path / "weights", model_config=model_dir)
    trainer = ThreadedTorchTrainer(model_dir, cfg)
    collector = make_collector(cfg, gen, tiny_prompts(40))
    records = []

    async def on_step(record):
        records.append(record)
        if record.step == 1:  # weights v2 are published: crash now, restart with the original weights
            server.kill()
            server.start()

    async def main():
        await gen.start()
        try:
            await gen.load_weights(trainer.generation_weights(), 0)  # cold sync: the servers serve the trainer's weights
            return await run_pipeline(cfg, collector=collector, trainer=trainer, generator=gen, on_step=on_step)
        finally:
            await gen.aclose()

    result = run(main(), timeout_s=110)
    assert result.outcome == "completed" and result.steps == 6, result.diagnostic
    assert collector.counters["rollout/failed_total"] == 0  # the outage cost retries and waiting, no rollout
    assert all(max(r.staleness) <= 1 for r in records)
    state = gen.stats()
    assert state["unhealthy_marks"] >= 1 and state["recoveries"] >= 1 and state["weight_sync_failures"] == 0
    restarted = server.stats()
    assert restarted["reloads"] >= 2  # the latest weights when it came back, then every later version
    assert restarted["serving_version"] == 6 and state["serving_version"] == 6
    assert collector.accounting.balanced()


def test_a_killed_server_that_stays_dead_fails_the_run_with_backend_dead(servers):
    server = servers["crash"]
    if not server.alive():
        server.start()
    server.wait_healthy()
    cfg = recipe([server.url], train={"max_steps": 50},
                 generation={"backend_dead_after_s": 2.0, "request_timeout_s": 3.0, "rollout_deadline_s": 30.0})
    gen = HttpGenerator(cfg.generation)
    collector = make_collector(cfg, gen, tiny_prompts(40))
    killed_at: list[float] = []

    async def on_step(record):
        if record.step == 1:
            server.kill()
            killed_at.append(time.monotonic())

    async def main():
        await gen.start()
        try:
            return await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen, on_step=on_step)
        finally:
            await gen.aclose()

    result = run(main())
    elapsed = time.monotonic() - killed_at[0]
    d = result.diagnostic
    assert result.outcome == "failed" and d.kind == "backend_dead", d
    assert server.url in d.message and "unreachable" in d.message and "last error" in d.message
    assert isinstance(d.original, BackendDeadError)
    assert elapsed < 2.0 + 3.0 + 5.0, f"the run took {elapsed:.1f} s after the kill to fail"
    assert collector.accounting.balanced()


# ----------------------------------------------------------------------------- in-process fakes


def test_a_hung_server_ends_at_the_collectors_deadline_and_every_attempt_is_closed():
    async def main():
        hung = await FakeServer().start()
        hung.completion = "hang"
        cfg = recipe([hung.url], generation={"request_timeout_s": 0.4, "rollout_deadline_s": 1.0,
                                             "retry_backoff_s": 0.05, "retry_backoff_max_s": 0.1},
                     rollout={"max_generation_failures": 0})
        gen = HttpGenerator(cfg.generation)
        collector = make_collector(cfg, gen, tiny_prompts(8))
        await gen.start()
        try:
            started = time.monotonic()
            result = await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen)
            elapsed = time.monotonic() - started
            deadline = time.monotonic() + 10
            while hung.cancelled < hung.started:  # each attempt's connection is closed by the collector's timeout
                assert time.monotonic() < deadline, f"{hung.started - hung.cancelled} requests still open at the server"
                await asyncio.sleep(0.02)
            return result, elapsed, hung.started
        finally:
            await gen.aclose()
            await hung.stop()

    result, elapsed, attempts = run(main())
    d = result.diagnostic
    assert result.outcome == "failed" and d.kind == "generation_failures"
    assert "rollout_deadline_s" in str(d.original) and "no answer within" in str(d.original.__cause__)
    assert elapsed < 1.0 + 3.0
    assert attempts >= 4  # 2 rollouts of the first group, each retried at least once


@pytest.mark.parametrize(
    ("answer", "error", "words"),
    [
        ((429, {"error": {"message": "slow down"}}), TransientGenerationError, "slow down"),
        ((503, {"detail": "overloaded"}), TransientGenerationError, "overloaded"),
        ((408, "timeout"), TransientGenerationError, "408"),
        ((400, {"error": {"message": "This model's maximum context length is 512 tokens."}}), PromptRejectedError, "maximum context"),
        ((400, {"object": "error", "message": "The decoder prompt (length 600) is longer than the maximum model length of 512."}),
         PromptRejectedError, "longer than"),
        ((413, "too large"), PromptRejectedError, "413"),
        ((401, {"error": {"message": "bad key"}}), MisconfiguredBackendError, "api_key"),
        ((404, {"error": {"message": "The model `x` does not exist."}}), MisconfiguredBackendError, "does not exist"),
        ((422, {"detail": [{"loc": ["body", "n"], "msg": "bad"}]}), MisconfiguredBackendError, "422"),
        ((400, {"error": {"message": "temperature must be non-negative"}}), GenerationError, "temperature"),
        ((418, "teapot"), GenerationError, "418"),
        ((200, {"choices": [{"text": "abc", "finish_reason": "length"}]}), MisconfiguredBackendError, "token_ids"),
        ((200, "not json"), GenerationError, "not a completion"),
        ("abort", TransientGenerationError, "abort"),
    ],
)
def test_each_server_answer_maps_to_its_error_class(answer, error, words):
    async def main():
        fake = await FakeServer().start()
        if answer == "abort":
            fake.finish_reason = "abort"
        else:
            fake.completion = answer
        gen = HttpGenerator(recipe([fake.url]).generation)
        await gen.start()
        try:
            with pytest.raises(GenerationError) as caught:
                await gen.generate(request(3))
            return caught.value, fake
        finally:
            await gen.aclose()
            await fake.stop()

    caught, fake = run(main())
    assert type(caught) is error, caught
    assert words in str(caught) and fake.url in str(caught)
    assert fake.started == 1  # the generator itself never retries: that is the collector's policy
    sent = fake.requests[0]
    assert sent["prompt"] == [5, 6, 7] and sent["return_token_ids"] is True and sent["logprobs"] == 0
    assert "seed" not in sent and sent["model"] == "fake" and sent["n"] == 1  # generation.http.seed: none


def test_requests_fail_over_to_the_healthy_server_and_a_returning_server_takes_work_again():
    async def main():
        a, b = await FakeServer().start(), await FakeServer().start()
        gen = HttpGenerator(recipe([a.url, b.url]).generation)
        await gen.start()
        try:
            await asyncio.gather(*(gen.generate(request(i)) for i in range(8)))
            assert a.answered > 0 and b.answered > 0  # least outstanding spreads concurrent requests
            port = a.port
            await a.stop()
            for i in range(4):  # a's refusals mark it unhealthy; nothing waits, b answers
                completion = await retrying(gen, request(10 + i))
                assert completion.token_ids == (7, 8, 9)
            assert not gen.stats()["servers"][0]["healthy"]
            answered_by_b = b.answered
            await gen.generate(request(20))
            assert b.answered == answered_by_b + 1
            a2 = await FakeServer(port=port).start()  # the same address comes back
            deadline = time.monotonic() + 10
            while not gen.stats()["servers"][0]["healthy"]:
                assert time.monotonic() < deadline, "the probe did not see the server come back"
                await asyncio.sleep(0.02)
            await asyncio.gather(*(gen.generate(request(30 + i)) for i in range(8)))
            assert a2.answered > 0 and gen.stats()["recoveries"] == 1
            await a2.stop()
        finally:
            await gen.aclose()
            await b.stop()

    run(main())


async def retrying(gen, req):
    """What the collector does with a transient error, minus the backoff."""
    for _ in range(3):
        try:
            return await gen.generate(req)
        except TransientGenerationError:
            continue
    raise AssertionError("still failing after 3 attempts")


def test_a_server_whose_weight_install_fails_takes_no_work_until_a_later_install_succeeds(tmp_path):
    state = {"w": torch.zeros(2)}

    async def main():
        good, bad = await FakeServer().start(), await FakeServer().start()
        bad.reload_status = 500
        gen = HttpGenerator(recipe([good.url, bad.url]).generation, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            await gen.load_weights(state, 1)
            assert gen.serving_version == 1 and gen.stats()["weight_sync_failures"] == 1
            assert bad.control == ["/pause", f"reload {tmp_path / 'weights' / 'v000001'}", "/resume"]  # resumed anyway
            bad.started = 0
            await asyncio.gather(*(gen.generate(request(i)) for i in range(6)))
            assert bad.started == 0 and good.answered == 6  # the stale server gets nothing
            bad.reload_status = 200
            await gen.load_weights(state, 2)
            assert [s["version"] for s in gen.stats()["servers"]] == [2, 2] and gen.serving_version == 2
            await asyncio.gather(*(gen.generate(request(i)) for i in range(6)))
            assert bad.answered > 0
            good.reload_status = bad.reload_status = 404
            with pytest.raises(WeightSyncError) as caught:
                await gen.load_weights(state, 3)
            return caught.value
        finally:
            await gen.aclose()
            await good.stop()
            await bad.stop()

    error = run(main())
    assert error.kind == "misconfigured_backend" and "VLLM_SERVER_DEV_MODE=1" in str(error)


def test_a_server_whose_reload_hangs_is_left_behind_within_the_weight_sync_budget(tmp_path):
    async def main():
        good, slow = await FakeServer().start(), await FakeServer().start()
        slow.reload_status = "hang"
        cfg = recipe([good.url, slow.url], generation={"weight_sync_timeout_s": 1.0}).generation
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            started = time.monotonic()
            await gen.load_weights({"w": torch.zeros(2)}, 1)  # the pipeline would give up after 1.0 s
            elapsed = time.monotonic() - started
            assert elapsed < 1.0, f"load_weights took {elapsed:.2f} s, past the pipeline's deadline"
            servers = gen.stats()["servers"]
            assert gen.serving_version == 1 and servers[0]["version"] == 1
            assert servers[1]["excluded"] and "collective_rpc got no answer" in servers[1]["last_error"]
            assert slow.control[0] == "/pause" and slow.control[-1] == "/resume"  # not left paused
        finally:
            await gen.aclose()
            await good.stop()
            await slow.stop()

    run(main())


# ----------------------------------------------------------------------------- hung requests (adaptive attempt timeout)


async def learn_latencies(gen, n: int = MIN_SAMPLES) -> None:
    """Answered requests, so that the generator knows the server's latencies."""
    await asyncio.gather(*(gen.generate(request(1000 + i)) for i in range(n)))


def test_once_latencies_are_known_a_hung_attempt_is_abandoned_long_before_request_timeout_s():
    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url], generation={"request_timeout_s": 600.0,
                                                           "rollout_deadline_s": 1200.0}).generation)
        await gen.start()
        try:
            await learn_latencies(gen)
            fake.hang_requests = {MIN_SAMPLES + 1, MIN_SAMPLES + 2}
            req = request(7)
            errors = []
            for _ in range(2):  # the test's run() deadline (90 s) is far below request_timeout_s
                with pytest.raises(RequestTimeoutError) as caught:
                    await gen.generate(req)
                errors.append(caught.value)
            completion = await gen.generate(req)  # the retry of the same request is answered
            await until(lambda: fake.cancelled == 2, 10, "both abandoned requests to be closed at the server")
            return errors, completion, gen.stats(), fake
        finally:
            await gen.aclose()
            await fake.stop()

    errors, completion, stats, fake = run(main())
    assert completion.token_ids == (7, 8, 9)
    assert fake.url in str(errors[0]) and "attempt 1" in str(errors[0]) and "attempt 2" in str(errors[1])
    assert "99% latency" in str(errors[0]) and "request_timeout_s = 600" in str(errors[0])
    first, second = (float(str(e).split("budget of ")[1].split(" s")[0]) for e in errors)
    assert second == pytest.approx(2 * first, rel=0.01)  # a request that timed out gets twice the time
    assert stats["attempt_timeouts"] == 2 and fake.started == MIN_SAMPLES + 3


def test_hung_requests_are_retried_and_every_prompt_is_trained_without_waiting_for_request_timeout_s():
    """Every group must finish (the data runs out, stale groups are impossible): a hung rollout has to be
    retried. Without the adaptive timeout it would wait request_timeout_s = 600 s."""
    async def main():
        fake = await FakeServer().start()
        cfg = recipe([fake.url], generation={"request_timeout_s": 600.0, "rollout_deadline_s": 1200.0, "max_inflight": 4},
                     rollout={"max_staleness": 100, "stall_timeout_s": 1200.0}, train={"max_steps": 100})
        gen = HttpGenerator(cfg.generation)
        collector = make_collector(cfg, gen, tiny_prompts(40))
        fake.hang_requests = {41, 50, 60}  # after MIN_SAMPLES answers: the latencies are known
        await gen.start()
        try:
            result = await run_pipeline(cfg, collector=collector, trainer=StubTrainer(0.01), generator=gen)
            return result, collector, gen.stats(), fake
        finally:
            await gen.aclose()
            await fake.stop()

    result, collector, stats, fake = run(main())
    assert result.outcome == "completed" and result.stop_reason == "data_exhausted", result.diagnostic
    assert collector.accounting.trained == 40 and collector.counters["rollout/failed_total"] == 0
    assert stats["attempt_timeouts"] == 3 and collector.counters["rollout/retries_total"] == 3
    assert fake.started == 80 + 3 and fake.cancelled == 3


def test_requests_held_by_our_own_weight_install_are_not_abandoned(tmp_path):
    """The attempt clock stands still while its server is paused for a reload: a held request is not silent."""
    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url]).generation, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            await learn_latencies(gen)
            # Hold the requests for several times the adaptive attempt timeout learnt just now (its floor when
            # answers take ~1 ms; more on a loaded machine), so a running attempt clock would time them out.
            fake.reload_delay_s = max(1.0, 3 * gen._latency.timeout_s())
            publish = asyncio.create_task(gen.load_weights({"w": torch.zeros(2)}, 1))
            await until(lambda: fake.paused, 10, "the server to be paused")
            held = await asyncio.gather(*(gen.generate(request(i)) for i in range(4)))  # dispatched during the pause
            await publish
            return held, gen.stats()
        finally:
            await gen.aclose()
            await fake.stop()

    held, stats = run(main())
    assert [c.token_ids for c in held] == [(7, 8, 9)] * 4
    assert stats["attempt_timeouts"] == 0 and stats["serving_version"] == 1


def test_a_hung_attempt_is_abandoned_although_weights_are_installed_after_every_answer(tmp_path):
    """As a trainer publishes: an install after every step. Installs keep the latencies and the attempt's budget
    (they used to reset both, so a hung attempt was held for the whole request_timeout_s)."""
    state = {"w": torch.zeros(2)}

    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url], generation={"request_timeout_s": 600.0, "rollout_deadline_s": 1200.0}).generation,
                            weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            await learn_latencies(gen)
            fake.hang_requests = {MIN_SAMPLES + 1}
            hung = asyncio.create_task(gen.generate(request(7)))
            await until(lambda: fake.started == MIN_SAMPLES + 1, 10, "the hung request to reach the server")
            version = 1
            while not hung.done():  # bounded by run(): the old code held it for request_timeout_s = 600 s
                await gen.load_weights(state, version)
                await gen.generate(request(100 + version))
                version += 1
            with pytest.raises(RequestTimeoutError) as caught:
                await hung
            return caught.value, version, gen.stats()
        finally:
            await gen.aclose()
            await fake.stop()

    error, versions, stats = run(main())
    assert "a newer request was answered meanwhile" in str(error) and stats["attempt_timeouts"] == 1
    assert versions > 1 and stats["serving_version"] == versions - 1


def test_a_server_that_becomes_uniformly_slower_is_waited_for_not_cut():
    """Load: every answer takes 2 x the attempt budget. Newer requests are no faster, so nothing overtakes the
    older ones and no work is thrown away (the timeout used to cut every one of them at its budget)."""
    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url], generation={"http": {"base_urls": [fake.url], "attempt_timeout_min_s": 0.5}})
                            .generation)
        await gen.start()
        try:
            await learn_latencies(gen)
            budget = gen._latency.timeout_s()
            fake.delay_s = 2 * budget
            first = [asyncio.create_task(gen.generate(request(i))) for i in range(4)]
            await asyncio.sleep(1.2 * budget)  # the first wave is overdue now: a second wave is sent after that
            second = [asyncio.create_task(gen.generate(request(10 + i))) for i in range(4)]
            done = await asyncio.gather(*first, *second)
            return budget, done, gen.stats()
        finally:
            await gen.aclose()
            await fake.stop()

    budget, done, stats = run(main())
    assert budget == pytest.approx(0.5) and len(done) == 8 and stats["attempt_timeouts"] == 0


def test_a_server_that_answers_health_but_no_request_is_reported_by_name(caplog):
    async def main():
        fake = await FakeServer().start()
        gen = HttpGenerator(recipe([fake.url], generation={"max_inflight": 4}).generation)
        await gen.start()

        async def keep_trying(i):  # what the collector's retries do, without backoff
            while True:
                try:
                    await gen.generate(request(i))
                except RequestTimeoutError:
                    continue

        try:
            await learn_latencies(gen)
            fake.completion = "hang"
            with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(keep_trying(i)) for i in range(4)]
                    await until(lambda: any("looks hung" in r.getMessage() for r in caplog.records), 30,
                                "the silent server to be reported")
                    for task in tasks:
                        task.cancel()
            return fake.url
        finally:
            await gen.aclose()
            await fake.stop()

    url = run(main())
    reports = [r.getMessage() for r in caplog.records if "looks hung" in r.getMessage()]
    assert len(reports) == 1  # once per silence, not once per probe
    assert url in reports[0] and "of generation.max_inflight = 4 request slots" in reports[0]
    assert "abandoned and retried after" in reports[0]


# ----------------------------------------------------------------------------- weight sync with servers that stop answering


def test_weight_sync_does_not_wait_for_a_server_that_stops_mid_install_and_it_catches_up_when_back(tmp_path):
    async def main():
        good, stopped = await FakeServer().start(), await FakeServer().start()
        stopped.reload_status = "hang"
        cfg = recipe([good.url, stopped.url], generation={"weight_sync_timeout_s": 3000.0}).generation
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            publish = asyncio.create_task(gen.load_weights({"w": torch.zeros(2)}, 1))
            await until(lambda: any(c.startswith("reload") for c in stopped.control), 10, "the reload to reach the server")
            stopped.freeze()  # SIGSTOP in the middle of its reload: /health goes silent too
            await publish  # the reload's own bound is 0.8 x 3000 s: returning at all means nobody waited for it
            during = gen.stats()
            stopped.reload_status = 200
            stopped.thaw()  # SIGCONT
            await until(lambda: (s := gen.stats()["servers"][1])["healthy"] and s["version"] == 1 and not s["excluded"],
                        30, "the returning server to load the published weights")
            return during, gen.stats(), stopped.control, tmp_path / "weights" / "v000001"
        finally:
            await gen.aclose()
            await good.stop()
            await stopped.stop()

    during, after, control, path = run(main())
    servers = during["servers"]
    assert during["serving_version"] == 1 and servers[0]["version"] == 1 and servers[0]["healthy"]
    assert not servers[1]["healthy"] and servers[1]["version"] == 0
    assert during["weight_sync_failures"] == 0  # down, not broken: no failed install is held against it
    assert control[-3:] == ["/pause", f"reload {path}", "/resume"]  # the install it got when it came back
    assert after["recoveries"] == 1 and after["serving_version"] == 1


def test_weight_sync_with_every_server_stopped_fails_as_backend_dead_after_backend_dead_after_s(tmp_path):
    async def main():
        a, b = await FakeServer().start(), await FakeServer().start()
        cfg = recipe([a.url, b.url], generation={"weight_sync_timeout_s": 3000.0, "backend_dead_after_s": 1.0}).generation
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            a.freeze()
            b.freeze()
            with pytest.raises(BackendDeadError) as caught:
                await gen.load_weights({"w": torch.zeros(2)}, 1)
            return caught.value, a.url, b.url
        finally:
            a.thaw()
            b.thaw()
            await gen.aclose()
            await a.stop()
            await b.stop()

    error, a_url, b_url = run(main())
    assert error.kind == "backend_dead" and "publish weights v1" in str(error)
    assert a_url in str(error) and b_url in str(error) and "unreachable" in str(error)


def test_a_pause_that_gets_no_answer_counts_as_the_server_being_down_not_as_a_failed_install(tmp_path):
    """/pause does no work: unanswered within a probe's timeout, the server is treated as down (as a failed
    probe would), whichever of the probe and the install notices first; the run then fails as backend_dead."""
    async def main():
        fake = await FakeServer().start()
        fake.pause_hangs = True  # /health keeps answering: only the install sees the server silent
        cfg = recipe([fake.url], generation={"weight_sync_timeout_s": 3000.0, "backend_dead_after_s": 2.0}).generation
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights")
        await gen.start()
        try:
            with pytest.raises(BackendDeadError) as caught:
                await gen.load_weights({"w": torch.zeros(2)}, 1)
            return caught.value, gen.stats()
        finally:
            await gen.aclose()
            await fake.stop()

    error, stats = run(main())
    assert error.kind == "backend_dead" and "/pause got no answer" in str(error)
    assert stats["unhealthy_marks"] >= 1 and stats["weight_sync_failures"] == 0
