"""A command agent's spec (environments/agent_spec.py) and what its exit and stdout mean (agents/command.py), without a process."""

from __future__ import annotations

import pytest

from asyncgrpo.agents.command import AgentProcessError, reward_of, run_command
from asyncgrpo.environments.agent_spec import AgentCommand
from asyncgrpo.environments.factories import load_factory
from asyncgrpo.errors import ConfigError

AGENT = AgentCommand(("sh", "agent.sh"), "agent-command:sh agent.sh")


@pytest.mark.parametrize(("stdout", "value"), [
    (b"0.5\n", 0.5),
    (b"thinking...\n{\"reward\": 1, \"calls\": 2}\n\n  \n", {"reward": 1, "calls": 2}),  # the last non-empty line
    (b"null", None),
    (b"\"yes\"\n", "yes"),  # JSON, but not a reward: the episode checks it (agent/failed/bad_return), as a Python agent's return
])
def test_the_reward_is_the_last_non_empty_line_of_stdout_as_json(stdout, value):
    assert reward_of(0, stdout, b"") == value


@pytest.mark.parametrize(("returncode", "stdout", "stderr", "kind", "words"), [
    (127, b"", b"sh: no-such: not found\n", "not_found", "exit status 127, command not found); the end of its stderr: 'sh: no-such"),
    (3, b"1.0\n", b"", "exit", "exited with exit code 3 (its stderr is empty)"),
    (-9, b"1.0\n", b"", "exit", "was killed by SIGKILL"),
    (0, b"\n \n", b"", "no_reward", "exited 0 with nothing on stdout"),
    (0, b"1.0\nreward: 1\n", b"", "bad_output", "printed 'reward: 1' as the last line of stdout, which is not JSON"),
])
def test_each_bad_ending_is_an_error_naming_what_the_program_did(returncode, stdout, stderr, kind, words):
    with pytest.raises(AgentProcessError) as error:
        reward_of(returncode, stdout, stderr)
    assert error.value.kind == kind and words in error.value.what and error.value.fix


@pytest.mark.parametrize(("spec", "words"), [
    ("agent-command:no-such-agent-program --flag", "'no-such-agent-program' is not an executable file on PATH"),
    ("agent-command:./missing_agent.py", "'./missing_agent.py' is not an executable file"),
    ("agent-command:   ", "names no command"),
    ("agent-command:python 'unclosed", "cannot be split"),
])
def test_a_command_that_cannot_run_is_a_config_error_before_the_run(spec, words):
    with pytest.raises(ConfigError, match="env.factory") as error:
        load_factory(spec)
    assert words in str(error.value) and "Fix:" in str(error.value)


def test_a_command_is_split_as_a_shell_would_and_not_run():
    agent = load_factory("agent-command:sh -c 'exit 3' 'an argument'")
    assert isinstance(agent, AgentCommand) and agent.argv == ("sh", "-c", "exit 3", "an argument")


def test_a_row_that_is_not_json_is_an_error_before_any_process_starts():
    import asyncio

    with pytest.raises(AgentProcessError) as error:
        asyncio.run(run_command(AGENT, "http://127.0.0.1:1/s/k/v1", "k", {"prompt": "hi", "when": object()}, grace_s=1.0, on_killed=print))
    assert error.value.kind == "bad_row" and "not JSON" in error.value.what
