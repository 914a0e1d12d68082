"""An agent that is a command: one process per episode, pointed at its session, its reward read from its stdout.

Job: `run_command(command, base_url, key, row, ...)` starts the command (`env.factory: agent-command:<command line>`,
read into an `AgentCommand` by environments/agent_spec.py)
in a session (so a process group) of its own, with `OPENAI_BASE_URL` / `OPENAI_API_KEY` set to the
episode's session in its environment (what an unmodified `openai.OpenAI()` reads) and the prompt's row
as one line of JSON on its stdin, waits for it to exit, and returns the reward its stdout ends with:
the last non-empty line, JSON: a number, null, or an object whose "reward" is one (what a Python
agent returns; agents/episode.py checks the value). Its stderr is the agent's own log; the last of
it is quoted when the agent fails.

Endings: an exit status of 127 (the shell's "command not found"; also what the launcher exits with
when the command cannot be executed), any other non-zero status or death by a signal, a stdout with
no non-empty line, and a last line that is not JSON are each an `AgentProcessError` whose `kind`
names the counter (`agent/failed/<kind>`) and whose text says what the agent did.

Cancelled (its group is stale, the run stops): SIGTERM to its process group, `grace_s` for it to
exit, then SIGKILL to the group (reported through `on_killed`), and a bounded wait for the exit
before the cancellation goes on.

Invariants: nothing of the process group outlives `run_command`: when the command exits, whatever it
started in its group is sent SIGKILL at once (no signal goes to the group after its leader's exit
was seen, so a reused pid is never signalled), and on any other ending the group is killed before
`run_command` returns or raises. The launcher (agents/launcher.py: the group's leader, the command its child) ties
the group's life to this process: if the run dies, the kernel tells the launcher, which kills the group. Output is kept
bounded (the last `STDOUT_TAIL` bytes of stdout,
`STDERR_TAIL` of stderr). The wait for the exit has no deadline of its own: the episode's
(`env.step_timeout_s` between model calls) cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asyncgrpo.agents.launcher import NOT_FOUND
from asyncgrpo.environments.agent_spec import AgentCommand
from asyncgrpo.worker_process import REAP_TIMEOUT_S, describe_exit

LAUNCHER = str(Path(__file__).with_name("launcher.py"))  # run by path: argv[1] this process's pid, argv[2:] the command
STDOUT_TAIL = 64 * 1024
STDERR_TAIL = 2 * 1024


class AgentProcessError(Exception):
    """A command agent's ending that fails its rollout; `kind` is its `agent/failed/<kind>` counter, `fix` the advice."""

    def __init__(self, kind: str, what: str, fix: str) -> None:
        super().__init__(what)
        self.kind = kind
        self.what = what
        self.fix = fix


class _Pipes(asyncio.SubprocessProtocol):
    """The process's output (bounded tails) and its exit: SIGKILL to what is left of its group as soon as it is seen."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited = asyncio.Event()  # set once, never cleared
        self.drained = asyncio.Event()  # the process exited and its pipes are closed: the output is complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buffer, limit = (self.out, STDOUT_TAIL) if fd == 1 else (self.err, STDERR_TAIL)
        buffer += data
        del buffer[:-limit]

    def process_exited(self) -> None:
        assert self.transport is not None
        kill_group(self.transport.get_pid(), signal.SIGKILL)
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.drained.set()


def kill_group(pid: int, signum: int) -> None:
    """Send `signum` to the process group led by `pid` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


async def run_command(command: AgentCommand, base_url: str, key: str, row: Mapping[str, Any], *, grace_s: float,
                      on_killed: Callable[[str], None]) -> Any:
    """Play one episode (see the module docstring); the reward the command printed."""
    try:
        line = (json.dumps(dict(row)) + "\n").encode()
    except (TypeError, ValueError) as error:
        raise AgentProcessError("bad_row", f"could not be given its row: it is not JSON ({error})",
                                "keep the dataset's columns JSON values (text, numbers, lists, dicts)") from None
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key}
    transport, pipes = await asyncio.get_running_loop().subprocess_exec(
        _Pipes, sys.executable, LAUNCHER, str(os.getpid()), *command.argv, env=env, start_new_session=True,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdin = transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        stdin.write(line)  # buffered by the loop; a command that exits unread ends the pipe, not the episode
        stdin.close()
        try:
            await pipes.exited.wait()
        except asyncio.CancelledError:
            await _terminate(transport, pipes, grace_s, on_killed)
            raise
        with contextlib.suppress(TimeoutError):  # a process outside its group may hold the pipes open: the output so far
            async with asyncio.timeout(REAP_TIMEOUT_S):
                await pipes.drained.wait()
    finally:
        if not pipes.exited.is_set():
            kill_group(transport.get_pid(), signal.SIGKILL)
        transport.close()
    return reward_of(transport.get_returncode(), bytes(pipes.out), bytes(pipes.err))


async def _terminate(transport: asyncio.SubprocessTransport, pipes: _Pipes, grace_s: float, on_killed: Callable[[str], None]) -> None:
    """SIGTERM to the group, `grace_s` to exit, SIGKILL; the exit awaited (bounded) even if cancelled again."""
    pid = transport.get_pid()
    kill_group(pid, signal.SIGTERM)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await pipes.exited.wait()
    finally:
        if not pipes.exited.is_set():
            kill_group(pid, signal.SIGKILL)
            on_killed(f"was still running {grace_s:g} s (env.cancel_grace_s) after SIGTERM to its process group; the group "
                      "was killed (SIGKILL)")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REAP_TIMEOUT_S):
                    await pipes.exited.wait()


def reward_of(returncode: int | None, out: bytes, err: bytes) -> Any:
    """What the command's exit and output say: the JSON of its last non-empty stdout line, or the `AgentProcessError` of its ending."""
    stderr = err.decode(errors="replace").strip()
    said = f"; the end of its stderr: {stderr[-500:]!r}" if stderr else " (its stderr is empty)"
    if returncode == NOT_FOUND:
        raise AgentProcessError("not_found", f"could not be started (exit status 127, command not found){said}",
                                "check the command line of env.factory (the program on PATH, the script's path from the run's "
                                "working directory, its execute permission)")
    if returncode != 0:
        raise AgentProcessError("exit", f"{describe_exit(returncode)}{said}", "see the agent's stderr; it must exit 0 after "
                                "printing its reward as the last line of stdout")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise AgentProcessError("no_reward", f"exited 0 with nothing on stdout{said}",
                                "print the reward as the last line of stdout: a number, null, or a JSON object with \"reward\"")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise AgentProcessError("bad_output", f"printed {lines[-1][-200:]!r} as the last line of stdout, which is not JSON",
                                "print the reward as the last line of stdout: a number, null, or a JSON object with \"reward\" "
                                "(log to stderr)") from None
