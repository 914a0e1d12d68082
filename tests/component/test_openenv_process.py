"""OpenEnv environments in a worker process (env.isolation: process): the vendored tiny OpenEnv environment
(tests/tiny_openenv.py) runs end to end, and a cancel stops a plain environment's step. The codec: tests/unit/
test_openenv.py; behind a server: tests/integration/test_openenv_server.py. Skipped when `openenv` is not installed."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.environments.process_host import ProcessHost
from asyncgrpo.environments.protocol import EpisodeCancelled
from tests.unit.test_openenv import needs_openenv

pytestmark = pytest.mark.timeout(180)


def test_an_openenv_mcp_environment_runs_end_to_end_in_a_worker_process():
    needs_openenv()

    async def main():
        host = ProcessHost("openenv:tests.tiny_openenv:TinyEchoEnv", "tool")
        (first,) = await host.reset({"prompt": "say bye", "seed": 3})
        hello = await host.step("echo: hello")
        added = await host.step('add: {"a": 2, "b": 3}')
        wrong = await host.step("add: 2")
        bye = await host.step("echo: bye")
        await host.close()
        return first, hello, added, wrong, bye

    first, hello, added, wrong, bye = asyncio.run(main())
    assert first["role"] == "tool" and "echo: <message>" in first["content"] and "add: <{" in first["content"]
    assert hello.messages == ({"role": "tool", "content": "hello"},) and hello.reward == 0.0 and not hello.done
    assert added.messages[0]["content"] == "5" and added.reward is None
    assert wrong.messages[0]["content"].startswith("error: add takes a, b") and wrong.info == {"invalid_action": True}
    assert bye.reward == 1.0 and bye.done


def test_an_openenv_plain_environment_in_a_worker_process_is_stopped_by_cancel(tmp_path, monkeypatch):
    needs_openenv()
    ticks = tmp_path / "ticks"
    monkeypatch.setenv("TINY_OPENENV_TICKS", str(ticks))

    async def main():
        host = ProcessHost("openenv:tests.tiny_openenv:TinyTextEnv", "user")
        assert await host.reset({}) == ({"role": "user", "content": "ready"},)
        said = await host.step("hi")
        slow = asyncio.create_task(host.step("slow"))
        async with asyncio.timeout(60):
            while not ticks.exists():
                await asyncio.sleep(0.01)
        assert await host.cancel(grace_s=0.1) is True
        with pytest.raises(EpisodeCancelled):
            await slow
        return said, ticks.read_text().count("\n")

    said, after_cancel = asyncio.run(main())
    assert said.messages == ({"role": "user", "content": "heard hi"},) and said.reward == 2.0 and not said.done
    assert ticks.read_text().count("\n") == after_cancel < 200  # killed long before its 3 s of ticks
