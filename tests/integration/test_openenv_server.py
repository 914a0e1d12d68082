"""OpenEnv behind a local uvicorn server (tests.tiny_openenv:app): a session runs end to end, and a cancelled server
step that outlives the grace is reported abandoned and its session closed. Skipped when `openenv` is not installed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from asyncgrpo.environments.protocol import EpisodeCancelled
from tests.unit.test_openenv import needs_openenv

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path):
    """tests.tiny_openenv:app under uvicorn on a socket this test bound (no port race), ticking into tmp_path/ticks."""
    needs_openenv()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    env = dict(os.environ, TINY_OPENENV_TICKS=str(tmp_path / "ticks"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.tiny_openenv:app", "--fd", str(listener.fileno()), "--log-level", "warning"],
        cwd=ROOT, env=env, pass_fds=(listener.fileno(),),
    )
    listener.close()
    try:
        # The socket listens already, so this one request waits for uvicorn (importing openenv takes seconds
        # on a loaded machine) instead of each test's first call running out of its own timeout.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=150) as answer:
            assert answer.status == 200
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_an_openenv_server_session_runs_end_to_end(server):
    from asyncgrpo.environments.openenv import OpenEnvServerHost

    async def main():
        host = OpenEnvServerHost(f"openenv+ws://{server}", "user")
        first = await host.reset({"seed": 1})
        said = await host.step("hi")
        bye = await host.step("bye")
        await host.close()
        return first, said, bye

    first, said, bye = asyncio.run(main())
    assert first == ({"role": "user", "content": "ready"},)
    assert said.messages == ({"role": "user", "content": "heard hi"},) and said.reward == 2.0 and not said.done
    assert bye.done and bye.reward == 3.0


def test_a_server_step_that_outlives_the_grace_is_reported_abandoned_and_the_session_closed(server, tmp_path):
    from asyncgrpo.environments.openenv import OpenEnvServerHost

    ticks = tmp_path / "ticks"

    def count():
        return ticks.read_text().count("\n") if ticks.exists() else 0

    async def main():
        quick = OpenEnvServerHost(f"openenv+http://{server}", "user")
        await quick.reset({})
        await quick.step("hi")
        quick_stopped = await quick.cancel(grace_s=5)  # nothing in flight: the work has stopped

        host = OpenEnvServerHost(f"openenv+ws://{server}", "user")
        await host.reset({})
        slow = asyncio.create_task(host.step("slow"))
        async with asyncio.timeout(60):
            while count() < 3:
                await asyncio.sleep(0.01)
        stopped = await host.cancel(grace_s=0.2)
        with pytest.raises(EpisodeCancelled):
            await slow
        at_cancel = count()
        async with asyncio.timeout(60):  # OpenEnv cannot interrupt a step: the server keeps ticking (what "abandoned" means)
            while count() <= at_cancel:
                await asyncio.sleep(0.01)
        return quick_stopped, stopped, host

    quick_stopped, stopped, host = asyncio.run(main())
    assert quick_stopped is True and stopped is False
    assert host._client is None  # the session was closed
