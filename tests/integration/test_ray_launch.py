"""`asyncgrpo train ... runtime=ray generation.backend=http generation.http.launch.count=2` as a real process: the run
starts two `asyncgrpo serve` servers (builtin:tiny) as Ray actors on a local cluster and trains through them; a server
whose actor is killed (SIGKILL of the actor's worker) is replaced by a new actor on a new port, which the pool takes in
its place with the current weights before it takes work; at the same time (both recoveries overlap, to keep the test
short) the other server's process is killed, restarted on the same port and given the current weights before it takes
work; killed again with its restarts spent, it stays down and the run trains on through the new one, then stops
cleanly on SIGTERM (or completes its 100 steps). No server process
and no process of the Ray cluster survives the run (checked by pid). The test follows the run's stderr (no sleeping;
a restarted server's process is looked up with a bounded wait, as it is an external process).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import pytest

from tests.integration.ray_cluster import processes_of, still_running
from tests.integration.servers import wait_until
from tests.integration.train_process import read_until, start_train

LAUNCH = ("runtime=ray", "ray.num_cpus=2", "generation.backend=http", "generation.http.launch.count=2",
          "generation.http.launch.num_cpus=0.5", "generation.http.launch.max_restarts=1", "generation.http.launch.start_timeout_s=120",
          "rollout.groups_per_step=2", "rollout.group_size=4", "eval.every_steps=0", "checkpoint.every_steps=0",
          "train.max_steps=100", "run.shutdown_timeout_s=60", "generation.health_probe_interval_s=0.5",
          "generation.backend_dead_after_s=240")  # both servers restart at once: no server for a while


def line_with(proc: subprocess.Popen[str], text: str) -> str:
    """The first stderr line containing `text`; fails if the run ends first."""
    assert proc.stderr is not None
    line = next((line for line in proc.stderr if text in line), None)
    if line is None:
        pytest.fail(f"the run ended (exit {proc.wait()}) before logging {text!r}")
    return line


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def lines_until(proc: subprocess.Popen[str], done: Callable[[list[str]], bool]) -> list[str]:
    """The stderr lines up to the first at which `done(lines so far)`; fails if the run ends first (lines in any order)."""
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if done(lines):
            return lines
    pytest.fail(f"the run ended (exit {proc.wait()}) before logging what the test waits for: {''.join(lines)}")


def recovered_at(lines: list[str], url: str) -> int | None:
    """The version `url` served when it was healthy again, as `lines` say (None: not yet)."""
    back = [line for line in lines if f"server {url} is healthy again (serving version " in line]
    return int(back[0].split("(serving version ")[1].split(")")[0]) if back else None


def server_pid(temp_dir: str, port: str) -> int | None:
    """The pid of the launched `asyncgrpo serve` process listening on `port`, if it runs."""
    found = [pid for pid, cmdline in processes_of(temp_dir).items()
             if "asyncgrpo.commands.cli serve" in cmdline and f"--port {port}" in cmdline]
    return found[0] if found else None


@pytest.mark.timeout(400)
def test_launched_servers_train_a_killed_one_restarts_with_the_current_weights_then_stays_down_and_none_survives(
        tmp_path, ray_tmpdir):
    with start_train(tmp_path, *LAUNCH, env={"RAY_TMPDIR": ray_tmpdir}) as proc:
        urls = line_with(proc, "launched 2 generation servers: ").split(": ", 1)[1].strip().split(", ")
        assert len(urls) == 2 and all(url.startswith("http://127.0.0.1:") for url in urls)
        assert read_until(proc, "step "), f"the run ended before training (exit {proc.wait()}): {proc.stderr.read()}"
        port = urls[0].rsplit(":", 1)[1]
        first = server_pid(ray_tmpdir, port)
        replaced = server_pid(ray_tmpdir, urls[1].rsplit(":", 1)[1])
        assert first is not None and replaced is not None, processes_of(ray_tmpdir)
        actor = parent_of(replaced)  # the Ray worker of server-1's actor
        os.kill(actor, signal.SIGKILL)
        os.kill(first, signal.SIGKILL)

        def new_url(lines: list[str]) -> str | None:
            back = [line for line in lines if "warning: launched server server-1 is back at " in line]
            return back[0].split(" is back at ")[1].split()[0] if back else None

        def both_back(lines: list[str]) -> bool:
            url = new_url(lines)
            return url is not None and None not in (recovered_at(lines, urls[0]), recovered_at(lines, url))

        lines = lines_until(proc, both_back)
        text, url = "".join(lines), new_url(lines)
        assert url is not None and url != urls[1] and url.startswith("http://127.0.0.1:"), url
        assert "warning: the actor of launched server server-1 " in text, text
        assert "starting another in its place on a new port (0 restarts left)" in text, text
        assert "warning: launched server server-0 " in text and "restarting it on the same port (0 restarts left)" in text
        # the current weights, not the initial ones, before either takes work
        assert min(recovered_at(lines, urls[0]) or 0, recovered_at(lines, url) or 0) >= 1, text
        other = server_pid(ray_tmpdir, url.rsplit(":", 1)[1])
        assert other is not None and parent_of(other) != actor, processes_of(ray_tmpdir)
        second = wait_until(lambda: server_pid(ray_tmpdir, port), 30.0, "the restarted server's process")
        assert second != first
        os.kill(second, signal.SIGKILL)
        down = line_with(proc, "warning: launched server server-0 ")
        assert "stays down" in down and "the run goes on with the other servers" in down, down
        trained_on = read_until(proc, "step ")  # a progress line every 10 steps
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    assert trained_on or "completed 100 steps" in rest, f"the run did not train on through the new server: {rest}"
    # stopped by SIGTERM (exit 143, as in the local runtime), or done already if it trained the last steps meanwhile
    assert (code, "interrupted by SIGTERM" in rest) == (143, True) or (code, "completed 100 steps" in rest) == (0, True), rest
    assert "Traceback" not in rest
    assert still_running([first, second, replaced, actor, other], grace_s=5.0) == []
