"""reward.isolation: process: worker processes that time out, crash, raise and close like the contract says.

Every reward here is a module-level function, so the workers resolve it by name
(``tests.component.test_reward_processes:<name>``) as they resolve ``reward.functions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest

from asyncgrpo.errors import RewardError
from asyncgrpo.rewards.pool import WorkerStartError
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.types import Prompt
from asyncgrpo.worker_process import RemoteTraceback

pytestmark = pytest.mark.timeout(60)

PROMPT = Prompt(id=3, text="say a: ", token_ids=(1, 2), columns={"letter": "a"})
CATASTROPHIC_SUBJECT = "a" * 40 + "b"  # (a+)+$ backtracks ~2**40 times: hours, all of it holding the GIL


def catastrophic(prompts, completions, **kw):
    print("stuck", flush=True)  # for the orphan test: the call has begun
    re.match(r"(a+)+$", CATASTROPHIC_SUBJECT)
    return [0.0] * len(completions)


def length(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def which_process(prompts, completions, **kw):
    return [float(os.getpid())] * len(completions)


def exits_7(prompts, completions, **kw):
    os._exit(7)


def segfaults(prompts, completions, **kw):
    ctypes.string_at(0)


def hangs_up(prompts, completions, **kw):
    """Closes its link to the parent and keeps running: a worker that hung up without exiting."""
    for thing in gc.get_objects():
        if isinstance(thing, socket.socket):
            with contextlib.suppress(OSError):
                thing.shutdown(socket.SHUT_RDWR)
    time.sleep(60)


def missing_column(prompts, completions, **kw):
    raise KeyError("missing_column")


class Unpicklable(Exception):
    def __init__(self, code, detail):  # two required arguments: pickle cannot rebuild it from args
        super().__init__(f"code {code}: {detail}")


def raises_unpicklable(prompts, completions, **kw):
    raise Unpicklable(5, "judge refused")


def exits_3(prompts, completions, **kw):
    raise SystemExit(3)


def interrupts(prompts, completions, **kw):
    raise KeyboardInterrupt


async def async_length(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def scorer(*functions, timeout_s=5.0, workers=2):
    specs = [f"{fn.__module__}:{fn.__qualname__}" for fn in functions]
    return RewardScorer([(fn.__name__, fn) for fn in functions], timeout_s=timeout_s, isolation="process", specs=specs, workers=workers)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(coro):
    return asyncio.run(coro)


def test_a_catastrophic_regex_times_out_its_worker_is_killed_and_the_next_call_works():
    async def main():
        async with scorer(catastrophic, length, timeout_s=0.5, workers=1) as s:
            await s._call(s._entries[1], PROMPT, ["warm"])  # start the worker, so the timing below is the call's
            stuck_pid = s._pool.pids[0]
            ticks = 0

            async def tick():  # the event loop keeps turning while the regex runs in the worker
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticker = asyncio.create_task(tick())
            began = time.monotonic()
            with pytest.raises(RewardError) as err:
                await s.score(PROMPT, ["aa", "bbb"])
            elapsed = time.monotonic() - began
            ticker.cancel()
            assert not alive(stuck_pid)
            assert (await s._call(s._entries[1], PROMPT, ["aa", "bbb"]))[0] == [2.0, 3.0]  # a new worker serves
            assert s._pool.pids != [stuck_pid]
            return err.value, elapsed, ticks

    error, elapsed, ticks = run(main())
    assert "'catastrophic' did not return within reward.timeout_s = 0.5 s for a group of 2 completions" in str(error)
    assert isinstance(error.__cause__, TimeoutError)
    assert elapsed < 0.5 + 10  # it ends at all: in a thread this call never returns (and starves the loop)
    assert ticks >= 5


def test_results_exceptions_and_the_remote_traceback_come_back():
    async def main():
        async with scorer(length, async_length) as s:
            out = await s.score(PROMPT, ["aa", "b"])
            assert [r.terms for r in out] == [{"length": 2.0, "async_length": 2.0}, {"length": 1.0, "async_length": 1.0}]
        async with scorer(missing_column) as s:
            with pytest.raises(RewardError) as err:
                await s.score(PROMPT, ["aa"])
            return err.value

    error = run(main())
    assert "'missing_column' raised KeyError: 'missing_column'" in str(error) and "Fix: fix the function" in str(error)
    assert isinstance(error.__cause__, KeyError)
    assert isinstance(error.__cause__.__cause__, RemoteTraceback)
    assert 'raise KeyError("missing_column")' in str(error.__cause__.__cause__)


@pytest.mark.parametrize(
    ("fn", "raised"),
    [(raises_unpicklable, "Unpicklable: code 5: judge refused"), (exits_3, "SystemExit: 3"), (interrupts, "KeyboardInterrupt")],
)
def test_any_exception_is_a_reward_error_and_the_worker_keeps_serving(fn, raised):
    async def main():
        async with scorer(fn, which_process, workers=1) as s:
            first = (await s._call(s._entries[1], PROMPT, ["a"]))[0]
            with pytest.raises(RewardError) as err:
                await s._call(s._entries[0], PROMPT, ["a"])
            assert (await s._call(s._entries[1], PROMPT, ["a"]))[0] == first  # the same worker
            return err.value

    assert f"raised {raised}" in str(run(main()))


@pytest.mark.parametrize(("fn", "exit_text"), [
    (exits_7, "exited with exit code 7"), (segfaults, "was killed by SIGSEGV (exit code -11)"),
    (hangs_up, "closed its connection and was killed"),  # not "killed by SIGKILL": that kill was ours
])
def test_a_worker_that_dies_is_a_reward_error_naming_the_function_and_exit_code_and_is_replaced(fn, exit_text, monkeypatch):
    monkeypatch.setattr("asyncgrpo.rewards.pool.REAP_TIMEOUT_S", 1.0)  # how long a worker that hung up may take to exit

    async def main():
        async with scorer(fn, length, workers=1) as s:
            with pytest.raises(RewardError) as err:
                await s.score(PROMPT, ["a"])
            assert (await s._call(s._entries[1], PROMPT, ["abc"]))[0] == [3.0]
            return err.value

    error = run(main())
    assert f"reward function {fn.__name__!r} crashed its worker process: it {exit_text}" in str(error)
    assert "'say a: '" in str(error) and "Fix" in str(error)


def test_an_idle_worker_killed_from_outside_is_replaced_and_its_pid_is_never_signalled_after_its_exit(monkeypatch):
    signalled = []
    real_killpg = os.killpg
    monkeypatch.setattr("asyncgrpo.worker_process.os.killpg", lambda pid, sig: (signalled.append(pid), real_killpg(pid, sig)))

    async def main():
        async with scorer(length, workers=1) as s:
            await s.score(PROMPT, ["a"])
            (worker,) = s._pool._idle
            os.kill(worker.process.pid, signal.SIGKILL)  # say, the OOM killer
            assert await worker.process.exit_within(10) and worker.process.returncode == -signal.SIGKILL
            seen = len(signalled)  # the group was signalled once when the exit was seen (for what it started)
            assert [r.reward for r in await s.score(PROMPT, ["abc"])] == [3.0]  # served by a new worker
            dead = worker.process.pid
        return dead, signalled[seen:]

    dead, after_exit = run(main())
    assert dead not in after_exit  # its pid may belong to another process by now


def test_calls_beyond_the_worker_count_wait_for_a_free_worker():
    async def main():
        async with scorer(which_process, workers=2) as s:
            results = await asyncio.gather(*(s.score(PROMPT, ["a"]) for _ in range(6)))
            return {r[0].reward for r in results}

    pids = run(main())
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids


def test_close_leaves_no_process_behind_and_later_calls_fail():
    async def main():
        s = scorer(length, catastrophic, timeout_s=0.3, workers=2)
        await asyncio.gather(s._call(s._entries[0], PROMPT, ["a"]), s._call(s._entries[0], PROMPT, ["b"]))
        started = s._pool.pids  # two workers, both idle now
        with pytest.raises(RewardError, match="did not return within"):
            await s._call(s._entries[1], PROMPT, ["a"])  # kills one of them
        assert len(s._pool.pids) == 1
        await s.aclose()
        with pytest.raises(WorkerStartError, match="closed"):
            await s.score(PROMPT, ["a"])
        return started

    started = run(main())
    assert len(started) == 2 and not any(alive(pid) for pid in started)


def test_starting_a_worker_is_not_part_of_the_deadline(tmp_path, monkeypatch):
    (tmp_path / "ag_slow_import_rewards.py").write_text(
        "import sys, time\n"
        "if sys.argv[0] == '-c':  # in a worker only: its import takes twice the deadline\n"
        "    time.sleep(1.0)\n"
        "def score(prompts, completions, **kw):\n"
        "    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import ag_slow_import_rewards

    s = RewardScorer([("score", ag_slow_import_rewards.score)], timeout_s=0.5, isolation="process", specs=["ag_slow_import_rewards:score"])

    async def main():
        async with s:
            return await s.score(PROMPT, ["a"])

    assert [r.reward for r in run(main())] == [1.0]


def test_a_worker_that_cannot_load_the_function_says_so():
    parent_only = types.ModuleType("ag_parent_only_rewards")
    exec("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n", parent_only.__dict__)
    sys.modules["ag_parent_only_rewards"] = parent_only
    try:
        s = RewardScorer([("score", parent_only.score)], isolation="process", specs=["ag_parent_only_rewards:score"])

        async def main():
            async with s:
                await s.score(PROMPT, ["a"])

        with pytest.raises(WorkerStartError) as err:
            run(main())
    finally:
        del sys.modules["ag_parent_only_rewards"]
    msg = str(err.value)
    assert "could not load the reward functions" in msg and "reward.functions[0]" in msg and "reward.isolation: thread" in msg


def test_a_busy_worker_dies_with_its_parent(tmp_path):
    # The parent is SIGKILLed (no finally, no atexit) while its worker is deep in the regex: the
    # kernel kills the worker too.
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(
        """
        import asyncio
        from tests.component.test_reward_processes import PROMPT, catastrophic, length, scorer

        async def main():
            s = scorer(length, catastrophic, timeout_s=3600, workers=1)
            await s._call(s._entries[0], PROMPT, ["a"])
            print("worker", s._pool.pids[0], flush=True)
            await s.score(PROMPT, ["a"])

        asyncio.run(main())
        """
    ))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root, env=env)
    worker_pid = None
    try:
        worker_pid = int(parent.stdout.readline().split()[1])
        assert parent.stdout.readline().strip() == "stuck"
        pidfd = os.pidfd_open(worker_pid)
        parent.kill()
        parent.wait(timeout=10)
        readable, _, _ = select.select([pidfd], [], [], 10)  # readable once the worker has exited
        os.close(pidfd)
        assert readable, f"worker {worker_pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()
        if worker_pid is not None and alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)  # only when the test failed: leave nothing behind
