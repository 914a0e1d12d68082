"""The OpenEnv adapter: the model's text becomes OpenEnv actions and observations become messages; a vendored tiny
OpenEnv environment (tests/tiny_openenv.py) runs end to end in a worker process and behind a local uvicorn server,
and a cancelled server step that outlives the grace is reported abandoned.

The codec tests need nothing; the others skip when `openenv` (the asyncgrpo[openenv] extra) is not importable.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from asyncgrpo.environments.openenv import ActionCodec, observation_text
from asyncgrpo.environments.process_host import ProcessHost
from asyncgrpo.environments.protocol import EpisodeCancelled

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
ECHO_TOOLS = [
    {"name": "echo", "description": "Say it back.", "input_schema": {"properties": {"message": {"type": "string"}}, "required": ["message"]}},
    {"name": "add", "input_schema": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
]
TEXT_ACTION_SCHEMA = {"properties": {"metadata": {"type": "object"}, "text": {"type": "string"}}, "required": ["text"]}


def needs_openenv():
    pytest.importorskip("openenv.core.env_server.interfaces", reason="openenv is not installed: pip install 'asyncgrpo[openenv]'")


def test_tool_calls_in_the_documented_syntax_become_call_tool_actions():
    codec = ActionCodec(None, ECHO_TOOLS)
    assert codec.parse("echo: hello there\n") == {"type": "call_tool", "tool_name": "echo", "arguments": {"message": "hello there"}}
    assert codec.parse('\n add: {"a": 2, "b": 3}') == {"type": "call_tool", "tool_name": "add", "arguments": {"a": 2, "b": 3}}
    assert codec.parse("add: 2 3").startswith("error: add takes a, b")
    assert codec.parse("add: {oops").startswith("error: the action is not valid JSON")
    assert codec.parse("the answer is 5") is None and codec.parse("answer: 5") is None  # no listed tool: a final answer
    assert "echo: <message>  Say it back." in codec.tool_list() and 'add: <{"a": ..., "b": ...}>' in codec.tool_list()


def test_plain_actions_fill_their_one_string_field_or_come_as_json():
    assert ActionCodec(TEXT_ACTION_SCHEMA, None).parse("go north") == {"text": "go north"}
    two_fields = {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    assert ActionCodec(two_fields, None).parse(' {"x": 1, "y": 2} ') == {"x": 1, "y": 2}
    assert ActionCodec(two_fields, None).parse("[1, 2]") == "error: the action must be a JSON object"


def test_observations_become_text():
    call = {"tool_name": "add", "result": {"content": [{"type": "text", "text": "5"}], "data": 5}, "error": None, "done": False, "reward": None}
    assert observation_text(call) == "5"
    assert observation_text({"tool_name": "x", "result": None, "error": {"message": "Unknown tool: 'x'"}}) == "error: Unknown tool: 'x'"
    assert observation_text({"heard": "hi", "done": False, "reward": 1.0, "metadata": {}}) == "hi"
    assert observation_text({"a": 1, "b": "two", "metadata": {}}) == "a: 1\nb: two"


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


def test_without_openenv_its_specs_are_config_errors_naming_the_extra(monkeypatch):
    from asyncgrpo.config import EnvConfig
    from asyncgrpo.environments.factories import load_factory
    from asyncgrpo.environments.hosts import check_env
    from asyncgrpo.errors import ConfigError

    for name in [n for n in sys.modules if n == "openenv" or n.startswith("openenv.")] + ["openenv"]:
        monkeypatch.setitem(sys.modules, name, None)  # import openenv... raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncgrpo\[openenv\]'"):
        load_factory("openenv:tests.tiny_openenv:TinyEchoEnv")
    with pytest.raises(ConfigError, match="openenv-core"):
        check_env(EnvConfig(factory="openenv+ws://127.0.0.1:1"))


def test_open_host_serves_process_isolation_and_server_urls():
    from asyncgrpo.config import EnvConfig
    from asyncgrpo.environments.hosts import open_host
    from asyncgrpo.environments.thread_host import ThreadHost

    assert isinstance(open_host(EnvConfig(factory="tests.envs:AsyncEcho", isolation="process")), ProcessHost)
    assert isinstance(open_host(EnvConfig(factory="tests.envs:AsyncEcho")), ThreadHost)
    needs_openenv()
    from asyncgrpo.environments.openenv import OpenEnvServerHost

    host = open_host(EnvConfig(factory="openenv+ws://127.0.0.1:1", isolation="process"))
    assert isinstance(host, OpenEnvServerHost) and host.base_url == "ws://127.0.0.1:1"


def test_an_openenv_class_spec_is_checked_when_loaded():
    needs_openenv()
    from asyncgrpo.environments.factories import load_factory
    from asyncgrpo.errors import ConfigError

    episode = load_factory("openenv:tests.tiny_openenv:TinyTextEnv")()
    assert episode.reset({}) == "ready" and episode.step("yo") == ("heard yo", 2.0, False, {})
    episode.close()
    with pytest.raises(ConfigError, match="not a subclass of OpenEnv's Environment"):
        load_factory("openenv:tests.tiny_openenv:TextAction")
