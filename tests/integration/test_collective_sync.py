"""`generation.http.weight_sync: nccl` against fake engines that are real processes over gloo (collective_server.py).

Two fake servers for the module (A stays well, B gets the faults); `HttpGenerator` publishes through
`CollectiveWeightPublisher`, whose broadcast the servers receive with the same code as vLLM's worker. The
tests check what the servers hold (checksums of the received weights), not what the trainer believes:

- every version reaches every server, over one group per server formed once;
- a server that hangs in any phase (group init, start, broadcast, finish), or is killed mid-broadcast (after its
  first chunk): the publication returns (bounded by generation.weight_sync_timeout_s),
  the server is marked unhealthy and takes no work, one diagnostic names it and the phase, and the other
  server holds the new weights;
- on_failure: disk: a server whose group init fails loads that version and the next one from disk, sticky,
  while the other keeps the collective path;
- a sync that failed in finish leaves the server's update unfinished (vLLM's flag set, its layer-wise reload
  half done: collective_server.py models both): the next version's sync to it succeeds (on_failure: skip),
  and so does its load from disk (on_failure: disk), because the publisher abandons the update first.

The real vLLM engine (collective_vllm.py) is tested in test_vllm.py; CUDA in bench/gpu_smoke.sh.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.config import validate_config
from asyncgrpo.generation.collective_publisher import CollectiveWeightPublisher
from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.weight_delta import checksum
from tests.integration.servers import free_port, http, wait_until

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0  # generation.weight_sync_timeout_s: every hang below ends within it


class FakeEngine:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeEngine:
        return self.spawn().wait_healthy()

    def spawn(self) -> FakeEngine:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
        with open(self.log_dir / f"engine-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.collective_server", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        return self

    def wait_healthy(self) -> FakeEngine:
        wait_until(self._healthy, 60.0, f"the fake engine on {self.url}", poll_s=0.05)
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, (self.log_dir / f"engine-{self.port}.log").read_text()
        try:
            return http("GET", f"{self.url}/health", timeout_s=2.0)[0] == 200
        except OSError:
            return False

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def state(self) -> dict:
        status, body = http("GET", f"{self.url}/state", timeout_s=5.0)
        assert status == 200, body
        return body

    def fault(self, phase: str, mode: str) -> None:
        assert http("POST", f"{self.url}/fault", {"phase": phase, "mode": mode})[0] == 200

    def release(self) -> None:
        assert http("POST", f"{self.url}/release", {})[0] == 200

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("collective-logs")
    pair = [FakeEngine(logs), FakeEngine(logs)]
    try:
        for engine in pair:
            engine.spawn()  # both start at once
        for engine in pair:
            engine.wait_healthy()
        yield pair
    finally:
        for engine in pair:
            engine.kill()


@pytest.fixture
def fresh(engines):
    """The module's engines, restarted if a test killed one (a fresh process has no group and no weights)."""
    for engine in engines:
        engine.ensure_running()
    return engines


def config(urls: list[str], on_failure: str = "skip"):
    return validate_config({
        "run": {"name": "collective-test", "seed": 0},
        "data": {"source": "builtin:repeat_letter", "builtin_size": 8},
        "reward": {"functions": ["builtin:repeat_letter"]},
        "train": {"backend": "stub", "max_steps": 1},
        "generation": {"backend": "http", "weight_sync_timeout_s": TIMEOUT_S / 0.8,  # installs get 0.8 of it
                       "health_probe_interval_s": 60.0,  # no recovery install while a test looks at a failed server
                       "http": {"base_urls": urls, "startup_timeout_s": 30.0, "weight_sync": "nccl",
                                "collective": {"on_failure": on_failure, "chunk_mib": 1 / 1024}}},  # 1 KiB chunks: several per version
    }).generation


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
            "model.layers.0.mlp.weight": torch.randn(16, 16, generator=generator),
            "model.norm.weight": torch.ones(16)}


async def publish(gen: HttpGenerator, *versions: int) -> None:
    for version in versions:
        await gen.load_weights(weights(version), version)


def run_generator(cfg, tmp_path: Path, body):
    # The transport's own timeout far beyond the test: what bounds a hang here is the install's deadline and the
    # abandoned collective thread, not gloo giving up.
    collective = cfg.http.collective
    publisher = CollectiveWeightPublisher(tmp_path / "weights", on_failure=collective.on_failure,
                                          chunk_bytes=int(collective.chunk_mib * 2**20), collective_timeout_s=600.0)

    async def main():
        gen = HttpGenerator(cfg, weights_dir=tmp_path / "weights", publisher=publisher)
        await gen.start()
        try:
            async with asyncio.timeout(60):  # far above any bound under test: only a hang reaches it
                await body(gen)
        finally:
            await gen.aclose()
        return gen

    return asyncio.run(main())


def test_every_version_reaches_every_server_over_one_group_each(fresh, tmp_path):
    a, b = fresh
    gen = run_generator(config([a.url, b.url]), tmp_path, lambda gen: publish(gen, 1, 2))
    for engine in (a, b):
        state = engine.state()
        assert state["checksum"] == checksum(weights(2)) and state["version"] == "2"
        assert state["chunks"] > 1 and state["reloads"] == [] and not state["paused"]
    publisher = gen._weights.publisher
    assert isinstance(publisher, CollectiveWeightPublisher)
    assert gen.serving_version == 2 and publisher.counters["weight_sync_collective"] == 4
    assert publisher.diagnostics == {} and not (tmp_path / "weights").exists()  # nothing went through the disk


def check_bounded_marked_named_and_others_updated(gen: HttpGenerator, a: FakeEngine, b: FakeEngine, phase: str,
                                                 version: int) -> None:
    assert a.state()["checksum"] == checksum(weights(version))
    stats = {s["url"]: s for s in gen.stats()["servers"]}
    assert stats[a.url]["healthy"] and stats[a.url]["version"] == version
    # Marked: it takes no work. A hang is the deadline's (unhealthy); a death is seen by whichever side fails first:
    # the HTTP call (unhealthy) or the trainer's broadcast (kept out of work until a later install succeeds).
    assert not stats[b.url]["healthy"] or stats[b.url]["excluded"], stats[b.url]
    assert stats[b.url]["version"] != version
    diagnostic = gen._weights.publisher.diagnostics[b.url]
    assert f"phase '{phase}'" in diagnostic and b.url in diagnostic and f"v{version}" in diagnostic, diagnostic
    assert list(gen._weights.publisher.diagnostics) == [b.url]


@pytest.mark.parametrize("phase", ["group init", "start", "broadcast", "finish"])
def test_a_server_that_hangs_in_any_phase_is_bounded_marked_and_named_and_the_other_is_updated(fresh, tmp_path, phase):
    a, b = fresh
    b.fault(phase, "hang")
    gen = run_generator(config([a.url, b.url]), tmp_path, lambda gen: publish(gen, 3))
    check_bounded_marked_named_and_others_updated(gen, a, b, phase, 3)
    assert not {s["url"]: s for s in gen.stats()["servers"]}[b.url]["healthy"]  # no answer by the deadline: unhealthy
    assert b.state()["checksum"] != checksum(weights(3))
    b.release()


def test_after_a_failed_broadcast_the_next_version_forms_a_new_group(fresh, tmp_path):
    """The group of a failed sync is mid-stream and must not carry the next version (it would hang or misalign)."""
    import aiohttp

    from asyncgrpo.generation.http_control import HttpControl
    from asyncgrpo.generation.weight_sync import WeightSyncStepError

    _, b = fresh
    b.fault("broadcast", "error")  # the server refuses the data after the trainer began sending
    publisher = CollectiveWeightPublisher(tmp_path / "weights", on_failure="skip", chunk_bytes=1024, collective_timeout_s=600.0)

    async def main():
        async with aiohttp.ClientSession() as session:
            control = HttpControl(session, b.url, quick_s=5.0)
            with pytest.raises(WeightSyncStepError, match="phase 'broadcast'"):
                await publisher.install(control, await publisher.stage(weights(7), 7), TIMEOUT_S)
            await publisher.install(control, await publisher.stage(weights(8), 8), 30.0)

    asyncio.run(main())
    assert b.state()["checksum"] == checksum(weights(8)) and b.state()["version"] == "8"


def test_after_a_failed_finish_the_next_version_abandons_the_unfinished_update_and_reaches_the_server(fresh, tmp_path):
    """vLLM refuses every start while an update is active, and a failed finish leaves it active."""
    import aiohttp

    from asyncgrpo.generation.http_control import HttpControl
    from asyncgrpo.generation.weight_sync import WeightSyncStepError

    _, b = fresh
    b.fault("finish", "error")
    publisher = CollectiveWeightPublisher(tmp_path / "weights", on_failure="skip", chunk_bytes=1024, collective_timeout_s=600.0)

    async def main():
        async with aiohttp.ClientSession() as session:
            control = HttpControl(session, b.url, quick_s=5.0)
            with pytest.raises(WeightSyncStepError, match="phase 'finish'"):
                await publisher.install(control, await publisher.stage(weights(9), 9), 30.0)
            assert b.state()["active"]  # what the failed finish left: the fake refuses a start now, as vLLM does
            await publisher.install(control, await publisher.stage(weights(10), 10), 30.0)

    asyncio.run(main())
    state = b.state()
    assert state["checksum"] == checksum(weights(10)) and state["version"] == "10"
    assert not state["active"] and not state["reloading"]
    assert publisher.counters["weight_sync_collective_abandoned"] == 1 and publisher.counters["weight_sync_collective"] == 1


@pytest.mark.parametrize(("phase", "hinted"), [("group init", True), ("start", False)])
def test_the_server_start_hint_comes_only_with_a_refusal_that_can_mean_a_server_started_without_our_extension(
        fresh, tmp_path, phase, hinted):
    """By 'start' the abandon call has reached our extension, so a refused start is not about how the server started."""
    import aiohttp

    from asyncgrpo.generation.http_control import HttpControl
    from asyncgrpo.generation.weight_sync import WeightSyncStepError

    _, b = fresh
    b.fault(phase, "error")
    publisher = CollectiveWeightPublisher(tmp_path / "weights", on_failure="skip", chunk_bytes=1024, collective_timeout_s=600.0)

    async def main():
        async with aiohttp.ClientSession() as session:
            with pytest.raises(WeightSyncStepError, match=f"phase '{phase}'") as raised:
                await publisher.install(HttpControl(session, b.url, quick_s=5.0), await publisher.stage(weights(3), 3), 30.0)
            return str(raised.value)

    assert ("--worker-extension-cls" in asyncio.run(main())) is hinted


def test_on_failure_disk_loads_that_server_from_disk_from_then_on(fresh, tmp_path):
    a, b = fresh
    b.fault("group init", "error")
    gen = run_generator(config([a.url, b.url], on_failure="disk"), tmp_path, lambda gen: publish(gen, 4, 5))
    assert a.state()["checksum"] == checksum(weights(5)) and a.state()["reloads"] == []
    reloads = b.state()["reloads"]
    assert [Path(p).name for p in reloads] == ["v000004", "v000005"]  # this version at once, the next without a new try
    publisher = gen._weights.publisher
    assert publisher.counters["weight_sync_disk_fallbacks"] == 1 and publisher.counters["weight_sync_collective_failures"] == 1
    assert "phase 'group init'" in publisher.diagnostics[b.url] and "HTTP 500" in publisher.diagnostics[b.url]
    assert gen.serving_version == 5 and all(s["version"] == 5 for s in gen.stats()["servers"])


def test_on_failure_disk_abandons_a_failed_finish_before_loading_from_disk(fresh, tmp_path):
    a, b = fresh
    b.fault("finish", "error")
    gen = run_generator(config([a.url, b.url], on_failure="disk"), tmp_path, lambda gen: publish(gen, 11, 12))
    assert a.state()["checksum"] == checksum(weights(12))
    assert [Path(p).name for p in b.state()["reloads"][-2:]] == ["v000011", "v000012"] and not b.state()["reloading"]
    publisher = gen._weights.publisher
    assert "phase 'finish'" in publisher.diagnostics[b.url] and publisher.counters["weight_sync_disk_fallbacks"] == 1
    assert gen.serving_version == 12 and all(s["version"] == 12 for s in gen.stats()["servers"])


def test_a_server_killed_mid_broadcast_is_bounded_marked_and_named_and_the_other_is_updated(fresh, tmp_path):
    """Last in the module: it leaves B dead (a test after it would restart B, at the cost of a process start)."""
    a, b = fresh
    b.fault("broadcast", "die")  # exits after receiving its first chunk
    gen = run_generator(config([a.url, b.url]), tmp_path, lambda gen: publish(gen, 6))
    assert b.proc is not None and b.proc.wait(timeout=30) == 17
    check_bounded_marked_named_and_others_updated(gen, a, b, "broadcast", 6)


class _Answers:
    """A ControlClient whose /collective_rpc answers the given text (no process: the answer's checks only)."""

    url = "http://answers"

    def __init__(self, text: str) -> None:
        self.text = text

    async def post(self, path: str, **_: object) -> str:
        assert path == "/collective_rpc"
        return self.text


@pytest.mark.parametrize("text, error", [
    ('{"results": []}', "no worker answered"),
    ("null", "not one {\"abandoned\": bool} per worker (TypeError"),
    ('{"results": [null]}', "not one {\"abandoned\": bool} per worker (TypeError"),
    ('{"results": [{"applied": true}]}', "not one {\"abandoned\": bool} per worker (KeyError"),
    ("<html>", "not one {\"abandoned\": bool} per worker (JSONDecodeError"),
])
def test_an_abandon_answer_that_is_not_one_result_per_worker_is_a_named_error(tmp_path, text, error):
    from asyncgrpo.generation.weight_sync import WeightSyncStepError

    publisher = CollectiveWeightPublisher(tmp_path / "weights")
    with pytest.raises(WeightSyncStepError, match=re.escape(f"asyncgrpo_abandon_weight_update answered {text!r}")) as info:
        asyncio.run(publisher._abandon(_Answers(text), 1.0))
    assert error in str(info.value)
    asyncio.run(publisher._abandon(_Answers('{"results": [{"abandoned": false}]}'), 1.0))
    assert publisher.counters["weight_sync_collective_abandoned"] == 0
    asyncio.run(publisher._abandon(_Answers('{"results": [{"abandoned": true}]}'), 1.0))
    assert publisher.counters["weight_sync_collective_abandoned"] == 1
