"""The body of a launched server's Ray actor (generation/launch_actor.py), run in this process without Ray, over a
stand-in server (a few lines of http.server answering /health): a missing program and a server that dies or never
answers while starting are reported naming the server, its log's last lines and the fix, with its whole process group
gone; a server that exits mid-run is restarted on the same port until its restarts are spent; stop() leaves no process."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from asyncgrpo.generation.launch_actor import LaunchFailure, LaunchSpec, ServerActor
from tests.integration.ray_cluster import still_running
from tests.integration.servers import until

STAND_IN = """
import http.server, os, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == '/health' else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print('stand-in serving', sys.argv[1], os.environ['STAND_IN'], flush=True)
http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()
"""
DEAF = "import subprocess, time; print('child', subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)"


def actor(tmp_path: Path, command: tuple[str, ...], *, start_timeout_s: float = 30.0, max_restarts: int = 1) -> ServerActor:
    spec = LaunchSpec(name="server-0", command=command, model_args=("builtin:tiny",), args=(), env=(("STAND_IN", "1"),),
                      log_dir=str(tmp_path / "servers"), start_timeout_s=start_timeout_s, max_restarts=max_restarts)
    return ServerActor(spec, host="127.0.0.1")


def answers_health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_a_program_that_is_not_there_is_a_config_error_naming_the_key_and_the_fix(tmp_path):
    answer = asyncio.run(actor(tmp_path, ("no-such-server-program", "serve")).start())
    assert isinstance(answer, LaunchFailure) and answer.kind == "config"
    assert "'no-such-server-program'" in answer.message and "generation.http.launch" in answer.message
    assert "Fix: install it there, or set generation.http.launch.command to its full path" in answer.message


def test_a_server_that_dies_while_starting_is_reported_with_its_exit_code_and_log(tmp_path):
    code = "import sys; print('cannot load', sys.argv[1]); sys.exit(3)"
    answer = asyncio.run(actor(tmp_path, (sys.executable, "-c", code)).start())
    assert isinstance(answer, LaunchFailure) and answer.kind == "start"
    assert "server server-0" in answer.message and "exited with code 3 while starting" in answer.message
    assert "cannot load builtin:tiny" in answer.message and "Fix:" in answer.message


def test_a_server_that_never_answers_is_killed_with_its_process_group_at_the_deadline(tmp_path):
    server = actor(tmp_path, (sys.executable, "-c", DEAF), start_timeout_s=1.0)
    answer = asyncio.run(server.start())
    assert isinstance(answer, LaunchFailure)
    assert "did not answer GET /health within generation.http.launch.start_timeout_s = 1 s" in answer.message
    child = int(re.search(r"child (\d+)", answer.message).group(1))  # from the log's tail
    assert server._proc is not None and server._proc.returncode is not None
    assert still_running([child], grace_s=5.0) == []


def test_a_server_that_exits_is_restarted_on_the_same_port_until_its_restarts_are_spent(tmp_path):
    async def scenario() -> None:
        server = actor(tmp_path, (sys.executable, "-c", STAND_IN), max_restarts=1)
        url = await server.start()
        assert url == server.url and await asyncio.to_thread(answers_health, url)
        first = (await server.pids())[0]
        os.kill(first, signal.SIGKILL)
        exit_ = await server.exited(0)
        assert exit_ is not None and exit_.count == 1 and exit_.code == -signal.SIGKILL and exit_.restarted
        assert exit_.restarts_left == 0 and "stand-in serving builtin:tiny 1" in exit_.log_tail
        await until(lambda: answers_health(url), 30.0, "the restarted server's /health on the same URL")
        second = (await server.pids())[0]
        assert second != first
        os.kill(second, signal.SIGKILL)
        exit_ = await server.exited(1)
        assert exit_ is not None and exit_.count == 2 and not exit_.restarted
        assert await server.pids() == [os.getpid()]  # none runs: it stays down
        await server.stop()
        assert await server.exited(2) is None  # stopped: nobody waits for ever

    asyncio.run(scenario())


def test_stop_ends_the_servers_whole_process_group(tmp_path):
    async def scenario() -> list[int]:
        server = actor(tmp_path, (sys.executable, "-c", STAND_IN))
        assert isinstance(await server.start(), str)
        pids = (await server.pids())[:1]
        await server.stop()
        return pids

    pids = asyncio.run(scenario())
    assert len(pids) == 1 and still_running(pids, grace_s=5.0) == []


OWNER = """
import asyncio, sys
from asyncgrpo.generation.launch_actor import LaunchSpec, ServerActor

async def main():
    spec = LaunchSpec(name="server-0", command=(sys.executable, "-c", sys.argv[1]), model_args=("builtin:tiny",), args=(),
                      env=(("STAND_IN", "1"),), log_dir=sys.argv[2], start_timeout_s=30.0, max_restarts=0)
    server = ServerActor(spec, host="127.0.0.1")
    assert isinstance(await server.start(), str)
    print((await server.pids())[0], flush=True)
    await asyncio.get_running_loop().create_future()  # until killed, as an actor is by ray.kill

asyncio.run(main())
"""


def test_a_server_dies_with_the_actor_process_that_owns_it(tmp_path):
    """What `ray.kill` of an actor does: SIGKILL of its process, which cannot stop its server; the server goes too."""
    with subprocess.Popen([sys.executable, "-c", OWNER, STAND_IN, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}) as owner:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        owner.kill()
    assert line.strip().isdigit(), f"the owner did not start its server (exit {owner.returncode})"
    left = still_running([int(line)], grace_s=10.0)
    for pid in left:  # a failing test leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert left == []
