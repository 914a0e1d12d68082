"""generation.http.weight_sync = delta against `asyncgrpo serve`: deltas applied in place, bit-exact, with a full load
whenever the server holds another base or the checksum fails; a server killed or hung mid-sync is bounded and skipped.

The first test serves builtin:tiny in this process (aiohttp on a real socket) so that it can compare the engine's
weights with the trainer's bit for bit; the second runs two `asyncgrpo serve` processes and kills or stops one of
them while it applies a delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from aiohttp import web

from asyncgrpo.config import validate_config
from asyncgrpo.generation.delta_publisher import DeltaWeightPublisher
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.generation.serve import STATE, ServerState, create_app
from asyncgrpo.generation.weight_delta import FORMAT, checksum, dtype_names, encode_delta, save_delta
from asyncgrpo.generation.weight_sync import plain_tensors, write_weights
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from tests.integration.servers import ServeProcess, free_port, http

pytestmark = pytest.mark.timeout(120)


def generation_cfg(*urls: str, **generation: Any):
    return validate_config({
        "train": {"backend": "stub"},
        "generation": {"backend": "http", "health_probe_interval_s": 0.5,
                       "http": {"base_urls": list(urls), "startup_timeout_s": 30.0, "weight_sync": "delta"}, **generation},
    }).generation


@contextlib.asynccontextmanager
async def served_tiny() -> AsyncIterator[tuple[str, ServerState]]:
    net, tokenizer = build_tiny(0)
    engine = LocalEngine(net, tokenizer, name="serve:tiny", max_batch_size=8)
    app = create_app(engine, tokenizer, model_name="tiny", max_model_len=512,
                     vocab_size=net.get_input_embeddings().num_embeddings)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await engine.start()
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", app[STATE]
    finally:
        await runner.cleanup()
        await app[STATE].engine.aclose()
        app[STATE].prompt_threads.close()


def sparse_step(model: torch.nn.Module, fraction: float, seed: int) -> None:
    """Change `fraction` of every parameter's elements (what a bf16 step at a small learning rate does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[torch.rand(flat.numel(), generator=g) < fraction] += 0.01


def served_equals(state: ServerState, model: torch.nn.Module) -> bool:
    served = state.engine.weights()
    return all(torch.equal(served[name].view(torch.int32), t.view(torch.int32)) for name, t in model.state_dict().items())


def test_deltas_apply_in_place_bit_exact_and_a_wrong_base_or_a_failed_check_loads_the_full_weights(tmp_path):
    trainer = build_tiny(1)[0]

    async def main():
        async with served_tiny() as (url, state):
            gen = HttpGenerator(generation_cfg(url), weights_dir=tmp_path / "weights", model_config=build_tiny(1)[0].config.to_dict())
            await gen.start()
            try:
                await gen.load_weights(trainer.state_dict(), 0)  # the first version is whole
                assert served_equals(state, trainer) and gen.stats()["weight_sync_full_loads"] == 1
                full_bytes = gen.stats()["weight_sync_bytes_staged"]

                for version in (1, 2):  # sparse changes travel as deltas
                    sparse_step(trainer, 0.02, version)
                    await gen.load_weights(trainer.state_dict(), version)
                    assert served_equals(state, trainer)
                stats = gen.stats()
                assert stats["weight_sync_deltas"] == 2 and stats["weight_sync_delta_fallbacks"] == 0
                assert stats["weight_sync_bytes_staged"] - full_bytes < full_bytes / 5
                assert 0 < stats["weight_sync_changed_fraction"] < 0.05

                # The served weights drift behind the publisher's back: the delta's checksum fails on the server,
                # which keeps serving, and the full weights are loaded instead.
                drifted = {name: t.clone() for name, t in state.engine.weights().items()}
                drifted["model.norm.weight"] += 1.0
                await state.engine.load_weights(drifted, state.engine.serving_version)
                sparse_step(trainer, 0.02, 3)
                await gen.load_weights(trainer.state_dict(), 3)
                assert served_equals(state, trainer)
                assert gen.stats()["weight_sync_delta_fallbacks"] == 1 and state.counters["delta_refusals"] == 1

                # Another base (a plain reload of other weights, as a restarted server has): a full load too.
                other = write_weights(build_tiny(2)[0].state_dict(), tmp_path / "other", 4)
                status, body = await asyncio.to_thread(http, "POST", f"{url}/collective_rpc", {
                    "method": "reload_weights", "kwargs": {"weights_path": str(other)}}, 30.0)
                assert status == 200, body
                sparse_step(trainer, 0.02, 4)
                await gen.load_weights(trainer.state_dict(), 4)
                assert served_equals(state, trainer)

                # Every element changed: a delta would be no smaller, the version is written whole.
                with torch.no_grad():
                    for p in trainer.parameters():
                        p += 0.001
                await gen.load_weights(trainer.state_dict(), 5)
                assert served_equals(state, trainer) and state.engine.serving_version == 5
                return gen.stats(), dict(state.counters)
            finally:
                await gen.aclose()

    stats, counters = asyncio.run(main())
    assert stats["weight_sync_deltas"] == 2 and stats["weight_sync_delta_fallbacks"] == 2
    assert stats["weight_sync_full_loads"] == 4 and stats["weight_sync_failures"] == 0
    assert counters["deltas_applied"] == 2 and counters["delta_refusals"] == 2


async def published_then_stepped(url: str, state: ServerState, trainer: torch.nn.Module, tmp_path) -> tuple[Any, dict[str, Any]]:
    """Publish `trainer`'s weights to the served engine as version 0, take a sparse step, and encode that step as a delta
    (from a copy of the base: `plain_tensors` gives views the step changes): the delta and its manifest."""
    base = {k: v.clone() for k, v in plain_tensors(trainer.state_dict(), tied_embeddings=False).items()}
    gen = HttpGenerator(generation_cfg(url), weights_dir=tmp_path / "weights", model_config=trainer.config.to_dict())
    await gen.start()
    try:
        await gen.load_weights(trainer.state_dict(), 0)
    finally:
        await gen.aclose()
    sparse_step(trainer, 0.02, 1)
    new = plain_tensors(trainer.state_dict(), tied_embeddings=False)
    delta = encode_delta(base, new)
    assert delta is not None
    manifest = {"format": FORMAT, "version": 1, "weights_id": "v1", "base": state.weights_id, "checksum": checksum(new),
                "dtypes": dtype_names(new)}
    return delta, manifest


def test_a_corrupted_delta_is_undone_in_the_engine_and_one_of_another_format_is_refused_before_any_write(tmp_path):
    trainer = build_tiny(1)[0]

    async def main():
        async with served_tiny() as (url, state):
            delta, manifest = await published_then_stepped(url, state, trainer, tmp_path)
            held = {name: t.clone() for name, t in state.engine.weights().items()}  # the served version 0
            # a tensor every server writes (not a tied head, which a server holding it tied skips by identity)
            values = next(key for key in sorted(delta.entries) if key.startswith("values/") and "q_proj" in key)
            delta.entries[values][-1] += 1.0  # one value corrupted on its way: every write lands, the check fails
            answers = []
            for name, changes in (("corrupted", manifest), ("format 1", {**manifest, "format": 1})):
                save_delta(tmp_path / name, delta, changes)
                status, body = await asyncio.to_thread(http, "POST", f"{url}/collective_rpc", {
                    "method": "asyncgrpo_apply_delta", "kwargs": {"delta_path": str(tmp_path / name)}}, 30.0)
                assert status == 200, body
                answers.append(body["results"][0])
                served = state.engine.weights()
                assert all(torch.equal(served[k].view(torch.int32), held[k].view(torch.int32)) for k in held), name
                assert state.engine.serving_version == 0 and state.engine.failure is None  # it keeps serving
            return answers, dict(state.counters)

    (corrupted, other_format), counters = asyncio.run(main())
    assert not corrupted["applied"] and "checksum" in corrupted["reason"] and "restored" in corrupted["reason"]
    assert not other_format["applied"] and "format 1" in other_format["reason"]
    assert counters["delta_refusals"] == 2 and counters["deltas_applied"] == 0


def test_a_delta_the_engine_does_not_install_in_time_is_answered_504_within_the_reload_bound(tmp_path, monkeypatch):
    # A decoding step that hangs holds the engine thread, so a weight load waits for it: the reload is bounded as the file
    # read is (reload_timeout_s), and the server keeps no base a later delta could apply to.
    from asyncgrpo.generation import weight_delta

    trainer = build_tiny(1)[0]
    apply = weight_delta.Patches.apply

    def slow_apply(self, weights):
        time.sleep(3.0)  # the engine thread is busy this long
        return apply(self, weights)

    async def main():
        async with served_tiny() as (url, state):
            delta, manifest = await published_then_stepped(url, state, trainer, tmp_path)
            save_delta(tmp_path / "d1", delta, manifest)
            state.reload_timeout_s = 0.5
            monkeypatch.setattr(weight_delta.Patches, "apply", slow_apply)
            started = time.monotonic()
            status, body = await asyncio.to_thread(http, "POST", f"{url}/collective_rpc", {
                "method": "asyncgrpo_apply_delta", "kwargs": {"delta_path": str(tmp_path / "d1")}}, 30.0)
            return status, body, time.monotonic() - started, state.weights_id

    status, body, elapsed, held = asyncio.run(main())
    assert status == 504 and elapsed < 2.5, (status, body, elapsed)
    assert held is None  # no delta may apply to a base this server is not sure it holds: the next sync is full


def test_servers_killed_and_hung_mid_delta_are_bounded_skipped_and_named_while_the_other_is_updated(tmp_path, monkeypatch, caplog):
    model_dir = save_model(*build_tiny(0), tmp_path / "tiny")
    servers = [ServeProcess(model_dir, tmp_path, extra=("--served-model-name", "tiny")).start() for _ in range(3)]
    killed, hung, survivor = servers
    faults = {killed.url: (killed, signal.SIGKILL), hung.url: (hung, signal.SIGSTOP)}
    trainer = build_tiny(0)[0]
    real_rpc = DeltaWeightPublisher._rpc

    async def faulty_rpc(self, server, method, kwargs, left):
        if server.url in faults and method == "asyncgrpo_apply_delta":  # paused, the delta on its way: now it fails
            victim, signum = faults[server.url]
            assert victim.proc is not None
            os.kill(victim.proc.pid, signum)
        return await real_rpc(self, server, method, kwargs, left)

    monkeypatch.setattr(DeltaWeightPublisher, "_rpc", faulty_rpc)

    async def main():
        gen = HttpGenerator(generation_cfg(*(s.url for s in servers), weight_sync_timeout_s=4.0),
                            weights_dir=tmp_path / "weights", model_config=model_dir)
        await gen.start()
        try:
            await gen.load_weights(trainer.state_dict(), 0)
            sparse_step(trainer, 0.02, 1)
            started = asyncio.get_running_loop().time()
            async with asyncio.timeout(30):  # the test's own guard; the bound under test is weight_sync_timeout_s
                await gen.load_weights(trainer.state_dict(), 1)
            return gen.stats(), asyncio.get_running_loop().time() - started
        finally:
            await gen.aclose()

    try:
        for s in servers:
            s.wait_healthy()
        stats, took = asyncio.run(main())
        by_url = {s["url"]: s for s in stats["servers"]}
        assert by_url[survivor.url]["version"] == 1 and by_url[survivor.url]["healthy"]
        assert survivor.stats()["deltas_applied"] == 1 and stats["weight_sync_deltas"] == 1
        for victim in (killed, hung):
            seen = by_url[victim.url]
            assert seen["version"] == 0 and (not seen["healthy"] or seen["excluded"]), seen
            named = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and victim.url in r.getMessage()]
            assert any("loading weights v1" in m or "weight install" in m for m in named), named  # it names the server
        print(f"killed and hung servers mid-delta: publication returned after {took:.2f} s; "
              f"{[by_url[v.url] for v in (killed, hung)]}")
    finally:
        if hung.proc is not None and hung.proc.poll() is None:
            os.kill(hung.proc.pid, signal.SIGCONT)
        for s in servers:
            s.kill()
