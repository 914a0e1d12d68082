"""The reaper (asyncgrpo/generation/ray_reaper.py) with a stand-in driver, no Ray: a driver SIGKILLed after a Ctrl-C
to its process group leaves none of its marked processes (a SIGTERM-deaf one gets SIGKILL) and no reaper, and
touches no process without its token; a dismissed reaper exits at once and stops nothing.

The stand-in driver starts, inside `marked_environment`, two children that ignore SIGINT as Ray's head processes
do (one ignores SIGTERM too), one child outside it, then the reaper; it prints the pids as JSON and waits for a
line on stdin: "dismiss" dismisses the reaper, then it waits again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from asyncgrpo.generation.ray_reaper import LOG_NAME
from tests.integration.ray_cluster import kill_processes, still_running

SLEEPER = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); {extra}print('ready', flush=True); time.sleep(600)"
DRIVER = textwrap.dedent(f"""
    import json, signal, subprocess, sys
    from asyncgrpo.generation.ray_reaper import Reaper, marked_environment

    def child(extra=""):
        proc = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}.format(extra=extra)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\\n"
        return proc.pid

    signal.signal(signal.SIGINT, lambda *_: None)  # a handler, as asyncgrpo's (SIG_IGN would be inherited by the reaper)
    with marked_environment(sys.argv[1]):
        marked = [child(), child("signal.signal(signal.SIGTERM, signal.SIG_IGN); ")]
    unmarked = child()
    reaper = Reaper.start(sys.argv[1], sys.argv[2])
    print(json.dumps({{"marked": marked, "unmarked": unmarked, "reaper": reaper.pid}}), flush=True)
    if sys.stdin.readline() == "dismiss\\n":
        reaper.dismiss()
        print("dismissed", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def driver(tmp_path):
    """(process, pids) of a stand-in driver leading a process group of its own; afterwards every pid it reported is killed."""
    (tmp_path / "logs").mkdir()
    with subprocess.Popen([sys.executable, "-c", DRIVER, "test-token-1", str(tmp_path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, start_new_session=True) as proc:
        pids = json.loads(proc.stdout.readline())
        try:
            yield proc, pids
        finally:
            kill_processes([proc.pid, *pids["marked"], pids["unmarked"], pids["reaper"]])


@pytest.mark.timeout(120)
def test_a_driver_sigkilled_after_a_ctrl_c_to_its_group_leaves_none_of_its_marked_processes(driver, tmp_path):
    proc, pids = driver
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the driver and its children ignore it, the reaper is elsewhere
    proc.kill()
    proc.wait()
    assert still_running([*pids["marked"], pids["reaper"]]) == []
    assert still_running([pids["unmarked"]], grace_s=0) == [pids["unmarked"]]
    log = (tmp_path / "logs" / LOG_NAME).read_text()
    assert f"SIGKILL to 1 alive 5 s later: {pids['marked'][1]} (" in log and log.endswith("none left\n"), log


@pytest.mark.timeout(120)
def test_a_dismissed_reaper_exits_at_once_and_stops_nothing(driver, tmp_path):
    proc, pids = driver
    proc.stdin.write("dismiss\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "dismissed\n"  # dismiss() returned: the reaper has exited
    assert still_running([pids["reaper"]], grace_s=0) == []
    proc.kill()
    proc.wait()
    assert still_running(pids["marked"], grace_s=0) == pids["marked"]
    assert not (tmp_path / "logs" / LOG_NAME).read_text()
