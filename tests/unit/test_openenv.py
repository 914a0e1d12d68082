"""The OpenEnv adapter: the model's text becomes OpenEnv actions and observations become messages, and OpenEnv specs
are checked. A vendored tiny OpenEnv environment (tests/tiny_openenv.py) runs end to end in a worker process
(tests/component/test_openenv_process.py) and behind a local uvicorn server (tests/integration/test_openenv_server.py).

The codec tests need nothing; the others skip when `openenv` (the asyncgrpo[openenv] extra) is not importable.
"""

from __future__ import annotations

import sys

import pytest

from asyncgrpo.environments.openenv import ActionCodec, observation_text
from asyncgrpo.environments.process_host import ProcessHost

pytestmark = pytest.mark.timeout(180)
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
