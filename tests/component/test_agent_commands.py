"""Agents that are programs (env.factory: agent-command:..., agents/command.py) in the collector, through the real gateway.

The generator is tests/agent_runs.py's fake (it answers at once with a scripted text, or never); the agents are real processes:
tests/command_agents.py (standard library only) and the example recipes/agent_command_calculator.py (the real openai client).
Each test agent records its process group's id in a folder, so a test can check that nothing of it is left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.agents.command import LAUNCHER, kill_group
from tests.agent_runs import CODEC, TextGenerator, first_batch, run_until, train_until_stale
from tests.integration.servers import wait_until
from tests.sim.fakes import make_collector, recipe

ROOT = Path(__file__).resolve().parents[2]


def command_recipe(command: str, *, rollout: dict | None = None, data: dict | None = None, inflight: int = 2, **env: object):
    return recipe(
        env={"factory": f"agent-command:{command}", "cancel_grace_s": 2.0, "max_turns": 3, "step_timeout_s": 60.0, **env},
        data=data or {},
        reward={"functions": []},
        generation={"max_inflight": inflight, "request_timeout_s": 60.0, "rollout_deadline_s": 60.0},  # hung, not retried
        rollout={"group_size": 2, "groups_per_step": 1, "min_group_survivors": 2, **(rollout or {})},
    )


def program(mode: str, record: Path) -> str:
    return shlex.join([sys.executable, str(ROOT / "tests" / "command_agents.py"), mode, str(record)])


PF_EXITING = 0x4  # the kernel's flag (in /proc/PID/stat) of a process in its exit


def alive_in_group(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are neither zombies (a zombie has stopped; its reaping is its parent's)
    nor ending: sent SIGKILL, which cannot be caught, or in their exit (on a loaded machine a killed process takes a
    moment to become a zombie, and this reads /proc at once)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            state, group, flags = fields[0], int(fields[2]), int(fields[6])
            exiting = flags & PF_EXITING or _sigkill_pending(status)
            if group == pgid and state not in ("Z", "X") and not exiting:
                alive.append(int(entry.name))
    return alive


def _sigkill_pending(status: str) -> bool:
    """Is SIGKILL pending for the process (its own or its thread group's pending set, in /proc/PID/status)?"""
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signal.SIGKILL - 1) & 1 for mask in masks)


def recorded(record: Path) -> dict[int, str]:
    return {int(path.name): path.read_text() for path in record.iterdir()}


def test_the_example_program_plays_its_episode_through_its_session_with_the_real_openai_client():
    # The calculator's first turn "=" computes the question's own expression (the tool-use term, 0.2); "0" is a wrong answer.
    generator = TextGenerator(lambda request: "=" if request.request_id.endswith("-t0") else "0")
    command = shlex.join([sys.executable, str(ROOT / "recipes" / "agent_command_calculator.py")])
    collector, batch = asyncio.run(first_batch(command_recipe(command, data={"source": "builtin:calculator"}), generator))
    completion = batch[0].rollouts[0].completion
    episode = completion.episode
    assert episode is not None and episode.turns == 2 and episode.env_reward == pytest.approx(0.2)
    assert episode.info[0]["tool_use"] == 1.0 and episode.info[0]["correct"] == 0.0
    # The model's ids as sampled, the agent's tool message as the template's delta, masked out.
    observation = [dict(m) for m in episode.messages][1]
    assert observation["role"] == "tool" and observation["content"].startswith("= ")
    delta = CODEC.encode(f"tool: {observation['content']}\nassistant: ")
    assert completion.token_ids == CODEC.encode("=") + delta + CODEC.encode("0")
    assert completion.loss_mask == (True,) + (False,) * len(delta) + (True,)
    assert collector.counters["env/errors_total"] == 0


@pytest.mark.parametrize(("command", "counter", "words"), [
    ("sh -c 'exec no-such-agent-program'", "agent/failed/not_found", "could not be started (exit status 127, command not found)"),
    ("sh -c 'echo my own bug >&2; exit 3'", "agent/failed/exit", "exited with exit code 3; the end of its stderr: 'my own bug'"),
    ("sh -c 'cat >/dev/null; echo 1.0'", "agent/failed/no_model_call", "returned 1.0 without a model call answered"),
    ("no_reward", "agent/failed/no_reward", "exited 0 with nothing on stdout"),
    ("garbage", "agent/failed/bad_output", "printed 'done!' as the last line of stdout, which is not JSON"),
])
def test_a_programs_bad_endings_fail_the_rollout_counted_and_named(command, counter, words, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    command = program(command, tmp_path) if " " not in command else command
    collector = make_collector(command_recipe(command), TextGenerator())
    asyncio.run(run_until(collector, lambda: collector.counters[counter] >= 2))
    assert collector.counters["env/errors_total"] >= 2 and collector.counters["rollout/failed_total"] >= 2
    logged = [r.getMessage() for r in caplog.records if counter in r.getMessage()]
    assert len(logged) == 1 and f"agent-command:{command}" in logged[0] and words in logged[0], logged
    assert all(not alive_in_group(pgid) for pgid in recorded(tmp_path))


def test_a_stale_groups_programs_are_killed_with_their_process_groups_and_nothing_of_any_agent_keeps_running(tmp_path, caplog):
    # Prompt 1's agents reach their second call, whose generation never answers; steps go on until the group is stale.
    # They ignore SIGTERM, and so does the sleep each started in its group: only SIGKILL after the grace ends them.
    caplog.set_level(logging.WARNING, logger="asyncgrpo")
    generator = TextGenerator(hang=lambda request: request.prompt_id == 1 and request.request_id.endswith("-t1"))
    cfg = command_recipe(program("stubborn", tmp_path), rollout={"max_requeues": 0}, inflight=4, cancel_grace_s=0.3)
    collector = make_collector(cfg, generator)
    asyncio.run(train_until_stale(collector, generator))
    hung = [r for r in generator.requests if r.prompt_id == 1 and r.request_id.endswith("-t1")]
    assert len(hung) == 2 and generator.aborted >= 2  # the stale group's requests in flight were aborted
    agents = recorded(tmp_path)
    stale = [pgid for pgid, question in agents.items() if question == "say d: "]
    assert len(stale) == 2 and len(agents) > 2
    assert {pgid: alive_in_group(pgid) for pgid in agents} == {pgid: [] for pgid in agents}  # no agent, no sleep of one
    assert collector.counters["agent/killed_total"] == 2 and collector.counters["env/abandoned_total"] == 0
    assert collector.counters["rollout/failed_total"] == 0 and collector.counters["env/errors_total"] == 0  # cancellation is no failure
    logged = [r.getMessage() for r in caplog.records if "agent/killed_total" in r.getMessage()]
    assert len(logged) == 1 and "SIGKILL" in logged[0] and "agent-command:" in logged[0], logged


def test_the_session_and_row_reach_the_program_in_its_environment_and_stdin(tmp_path):
    collector, batch = asyncio.run(first_batch(command_recipe(program("two_turns", tmp_path)), TextGenerator(lambda r: "abc")))
    episode = batch[0].rollouts[0].completion.episode
    assert episode.env_reward == 1.0 and episode.info == ({"turns": 2},) and episode.turns == 2
    assert batch[0].prompt.text in set(recorded(tmp_path).values())  # the row's prompt, read from stdin
    assert all(not alive_in_group(pgid) for pgid in recorded(tmp_path))  # each agent's sleep died with it


RUN = """
import asyncio, sys
from asyncgrpo.agents.command import run_command
from asyncgrpo.environments.agent_spec import AgentCommand

asyncio.run(run_command(AgentCommand(tuple(sys.argv[1:]), "agent-command:test"), "http://127.0.0.1:9/v1", "key", {"prompt": "q"}, grace_s=1.0,
                        on_killed=print))
"""


def test_the_runs_death_kills_a_running_programs_whole_process_group(tmp_path):
    # A run (here: a process playing one command agent's episode) is SIGKILLed while its agent waits, with a sleep it
    # started in its group: the kernel must end both, though the run can do nothing about it.
    run = subprocess.Popen([sys.executable, "-c", RUN, *shlex.split(program("waits", tmp_path))], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        def started() -> int | None:
            assert run.poll() is None, "the run ended before its agent started"
            return next(iter(recorded(tmp_path)), None)

        pgid = wait_until(started, 60.0, "the agent recording itself")
        assert len(alive_in_group(pgid)) >= 2  # the agent and its sleep
        run.kill()
        run.wait(timeout=30)
        wait_until(lambda: not alive_in_group(pgid), 30.0, f"the process group {pgid} ending: {alive_in_group(pgid)} alive")
    finally:
        run.kill()
        for pgid in recorded(tmp_path):
            kill_group(pgid, signal.SIGKILL)  # what a failed test left behind


def test_the_launcher_started_outside_a_group_of_its_own_refuses_and_signals_no_one():
    # Its kill on the run's death is a kill of its group: as a mere member of a shell's group (the shell's parent is not
    # the "run" it names) it would kill the shell. It must refuse instead, and the shell live on.
    shell = f"{shlex.quote(sys.executable)} {shlex.quote(LAUNCHER)} 1 true; echo survived $?"
    done = subprocess.run(["sh", "-c", shell], start_new_session=True, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "survived 1", done
    assert "must lead a process group of its own" in done.stderr
