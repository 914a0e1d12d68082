"""`RayGenerator` on a local Ray cluster (2 CPUs, one per test module): generation over two actors,
weights through the object store, cancellation, an actor killed mid-request (transient failure,
restart, current weights before work) and every actor killed (BackendDeadError at once). On the same
cluster, to start no other: launched HTTP servers that fail to start fail the launch driver.

Synchronisation: an actor's `holding(n)` returns once it holds n requests, and recoveries are
awaited with `RayGenerator.settled()`; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from asyncgrpo.config import load_config
from asyncgrpo.errors import BackendDeadError, ConfigError, TransientGenerationError
from asyncgrpo.generation.base import Generator
from asyncgrpo.generation.launch import ServerLauncher
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.generation.ray_pool import RayGenerator
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.types import Completion, GenerationRequest, SamplingParams
from tests.bounded import run_bounded
from tests.integration.ray_cluster import local_cluster, ray
from tests.integration.servers import wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_cpus=2) as temp_dir:
        yield temp_dir


def config(*overrides: str):
    return load_config(None, ["runtime=ray", "ray.generators=2", "ray.generator.num_cpus=0.5",
                              "generation.backend_dead_after_s=60", *overrides])


def run(coro, timeout_s: float = 150.0):
    return run_bounded(coro, timeout_s)


def request(rid: int, tokenizer, *, max_new_tokens: int = 8, temperature: float = 1.0) -> GenerationRequest:
    ids = tuple(tokenizer(f"say {'abcdefgh'[rid % 8]}: ")["input_ids"])
    return GenerationRequest(f"r{rid}", rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature), seed=rid)


def perturbed(model, scale: float = 0.5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {k: v.detach() + scale * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


async def holding(gen: RayGenerator, index: int, count: int) -> None:
    """Return once actor `index` holds `count` requests."""
    await gen.actor_handles[index].holding.remote(count, 60.0)


def test_two_actors_generate_and_take_new_weights_through_the_object_store(cluster):
    model, tokenizer = build_tiny(0)
    new_state = perturbed(model)

    async def scenario():
        gen = RayGenerator(config(), build_tiny(0)[0], tokenizer)
        assert isinstance(gen, Generator)
        await gen.start()
        try:
            first = await asyncio.gather(*(gen.generate(request(i, tokenizer)) for i in range(6)))
            assert all(isinstance(c, Completion) and set(c.versions) == {0} for c in first)
            assert [a["dispatched"] for a in gen.stats()["actors"]] == [3, 3]  # the least loaded actor takes each
            await gen.load_weights(new_state, 1)
            assert gen.serving_version == 1
            greedy = [request(i, tokenizer, temperature=0.0) for i in range(4)]
            after = await asyncio.gather(*(gen.generate(r) for r in greedy))
            return first, after
        finally:
            await gen.aclose()

    first, after = run(scenario())
    assert all(set(c.versions) == {1} and c.dispatch_version == 1 for c in after)

    async def reference():  # the same weights in an in-process engine give the same greedy tokens
        model.load_state_dict(new_state)
        engine = LocalEngine(model, tokenizer, version=1)
        await engine.start()
        try:
            return [await engine.generate(request(i, tokenizer, temperature=0.0)) for i in range(4)]
        finally:
            await engine.aclose()

    assert [c.token_ids for c in after] == [c.token_ids for c in run(reference())]


def test_cancelling_a_request_stops_it_on_the_actor(cluster):
    model, tokenizer = build_tiny(0)

    async def scenario():
        gen = RayGenerator(config("ray.generators=1", "generation.local.max_batch_size=1"), model, tokenizer)
        await gen.start()
        try:
            long = asyncio.create_task(gen.generate(request(0, tokenizer, max_new_tokens=480)))
            await holding(gen, 0, 1)
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long
            # One row at a time: this request starts only once the long one has left the engine.
            short = await gen.generate(request(1, tokenizer, max_new_tokens=4))
            return short, await gen.actor_handles[0].stats.remote()
        finally:
            await gen.aclose()

    short, stats = run(scenario())
    assert len(short.token_ids) <= 4
    assert stats["tokens_generated"] < 480, f"the cancelled request ran to its end: {stats}"


def test_a_killed_actor_fails_its_requests_as_transient_restarts_and_takes_the_current_weights_first(cluster):
    model, tokenizer = build_tiny(0)
    new_state = perturbed(model)

    async def scenario():
        gen = RayGenerator(config("generation.local.max_batch_size=1", "ray.max_restarts=1"), model, tokenizer)
        await gen.start()
        try:
            await gen.load_weights(new_state, 1)
            # 4 long requests per actor, one row at a time: actor 0 still holds some when it is killed.
            tasks = [asyncio.create_task(gen.generate(request(i, tokenizer, max_new_tokens=400))) for i in range(8)]
            await holding(gen, 0, 4)
            ray.kill(gen.actor_handles[0], no_restart=False)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await gen.settled()
            stats = gen.stats()
            restarted = await gen.actor_handles[0].stats.remote()
            # The restarted actor serves again, at version 1.
            again = await asyncio.gather(*(gen.generate(request(i, tokenizer)) for i in range(4)))
            return results, stats, restarted, again, gen.stats()
        finally:
            await gen.aclose()

    results, stats, restarted, again, final = run(scenario())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, TransientGenerationError) for r in failed), failed
    assert all(isinstance(r, Completion) for r in results[1::2])  # actor 1's requests are untouched
    assert stats["actor_failures"] == 1 and stats["recoveries"] == 1
    assert [a["state"] for a in stats["actors"]] == ["ready", "ready"]
    assert restarted["serving_version"] == 1
    assert all(set(c.versions) == {1} for c in again)
    assert final["actors"][0]["dispatched"] > stats["actors"][0]["dispatched"]  # it takes work again


def test_every_actor_dead_for_good_fails_at_once_with_a_diagnostic(cluster):
    model, tokenizer = build_tiny(0)

    async def scenario():
        gen = RayGenerator(config("ray.max_restarts=0"), model, tokenizer)
        await gen.start()
        try:
            for handle in gen.actor_handles:
                ray.kill(handle, no_restart=True)
            errors = await asyncio.gather(*(gen.generate(request(i, tokenizer)) for i in range(2)), return_exceptions=True)
            assert all(isinstance(e, TransientGenerationError) for e in errors), errors  # each actor dies under a request
            await gen.settled()
            with pytest.raises(BackendDeadError) as dead:
                await gen.generate(request(3, tokenizer))
            return str(dead.value)
        finally:
            await gen.aclose()

    message = run(scenario(), timeout_s=60)
    assert "ray-0: dead" in message and "ray-1: dead" in message and "ray.max_restarts" in message


def test_actors_the_cluster_cannot_place_fail_the_start_with_what_was_asked(cluster):
    model, tokenizer = build_tiny(0)

    async def scenario():
        gen = RayGenerator(config("ray.generator.num_cpus=4", "ray.startup_timeout_s=3"), model, tokenizer)
        try:
            with pytest.raises(BackendDeadError) as info:
                await gen.start()
        finally:
            await gen.aclose()
        return str(info.value)

    message = run(scenario(), timeout_s=60)
    assert "ray.startup_timeout_s = 3" in message and "ray.generator.num_cpus = 4" in message and "CPU" in message
    assert ray.available_resources().get("CPU") == 2  # the pending actors were removed


@pytest.mark.parametrize(("command", "error", "says"), [
    (["no-such-server-program", "serve"], ConfigError, "the program 'no-such-server-program' of generation.http.launch"),
    ([sys.executable, "-c", "import sys; print('cannot load', sys.argv[1]); sys.exit(3)"], BackendDeadError,
     "exited with code 3 while starting. Its log"),
])
def test_launched_servers_that_fail_to_start_fail_the_driver_with_the_error_their_actor_named(cluster, tmp_path, command,
                                                                                             error, says):
    """generation.http.launch (generation/launch.py) over this module's cluster: the failure an actor reports comes back
    through Ray to the driver, which raises its class naming each server, and leaves no actor holding the cluster."""
    cfg = load_config(None, ["runtime=ray", "generation.backend=http", "generation.http.launch.count=2",
                             "generation.http.launch.num_cpus=0.5", f"generation.http.launch.command={command}"])

    async def scenario():
        launcher = ServerLauncher(cfg, tmp_path)
        with pytest.raises(error) as info:
            await launcher.start()
        return str(info.value)

    message = run(scenario(), timeout_s=60)
    assert says in message and "server server-0" in message and "server server-1" in message, message
    if error is BackendDeadError:
        assert "cannot load" in message and "Fix:" in message  # its log's last lines, and what to do
    # both actors were killed (Ray frees their CPUs a moment later: a bounded wait on the cluster's own state)
    wait_until(lambda: ray.available_resources().get("CPU") == 2, 30.0, "the launched actors' CPUs to be free again")
