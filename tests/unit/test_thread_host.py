"""ThreadHost (environments/thread_host.py): the protocol's calls on owned threads, normalised, closed once,
and a cancel that closes even what a factory finishes making after it."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.environments.thread_host import ThreadHost
from asyncgrpo.threads import run_in_daemon_thread
from tests import envs


@pytest.fixture(autouse=True)
def fresh_envs():
    envs.reset_all()


def test_calls_are_normalised_and_close_reaches_the_environment_once():
    async def main():
        host = ThreadHost("tests.envs:Counting", "user")
        assert await host.reset({"prompt": "p"}) == ({"role": "user", "content": "say something"},)
        result = await host.step("hello")
        assert result.messages == ({"role": "user", "content": "again"},) and result.reward == 1.0 and not result.done
        await host.close()
        await host.close()
        assert await host.cancel(1.0) is True  # nothing runs any more
        return envs.Counting.instances[0]

    env = asyncio.run(main())
    assert env.closed == 1 and env.steps == 1


def test_async_methods_run_on_the_loop_and_get_the_token():
    async def main():
        host = ThreadHost("tests.envs:AsyncEcho", "tool")
        assert await host.reset({}) == ({"role": "tool", "content": "echo:"},)
        result = await host.step("banana")
        assert result.messages == ({"role": "tool", "content": "banana"},) and result.reward == 1.0
        assert host.running == 0

    asyncio.run(main())


def test_a_cancel_while_the_factory_runs_closes_what_it_makes():
    async def main():
        host = ThreadHost("tests.envs:SlowToMake", "user")
        reset = asyncio.ensure_future(host.reset({}))
        assert await run_in_daemon_thread(lambda: envs.STARTED.acquire(timeout=30), name="test-wait")
        reset.cancel()
        stopped = await host.cancel(30.0)
        with pytest.raises(asyncio.CancelledError):
            await reset
        return stopped

    assert asyncio.run(main()) is True
    assert [e.closed for e in envs.SlowToMake.instances] == [1]
