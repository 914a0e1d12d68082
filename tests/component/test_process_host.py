"""env.isolation: process: a cancelled episode's work stops (the environment's side effect stops moving and no
process is left), and what an environment raises or how its worker dies comes back classified.

Every environment here is a module-level class, so the worker creates it by name
(``tests.component.test_process_host:<Class>``) as it creates ``env.factory``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest

from asyncgrpo.environments.process_host import EnvironmentProcessDied, ProcessHost, RemoteEnvironmentError
from asyncgrpo.environments.protocol import EpisodeCancelled, TransientEnvironmentError
from asyncgrpo.worker_process import RemoteTraceback

pytestmark = pytest.mark.timeout(60)
HERE = "tests.component.test_process_host"


class Stubborn:
    """Ignores the token and close(): its step appends to a file forever, its close() never returns, and
    reset starts a `sleep` child."""

    def reset(self, row):
        self.path = Path(row["path"])
        self.sleeper = subprocess.Popen(["sleep", "600"])
        Path(row["pids"]).write_text(f"{os.getpid()} {self.sleeper.pid}")
        return "ready"

    def step(self, action_text):
        with self.path.open("a") as out:
            while True:
                out.write("tick\n")
                out.flush()
                time.sleep(0.002)

    def close(self):
        while True:
            time.sleep(1)


class Cooperative:
    """Waits in step until its token is cancelled; close() (called meanwhile, from another thread) records whether the
    step saw the token first."""

    def reset(self, row):
        self.path = Path(row["path"])
        self.saw_token = threading.Event()
        return None

    def step(self, action_text, token):
        self.path.write_text("stepping")
        if token.wait(60):
            self.saw_token.set()
        token.raise_if_cancelled()
        return None, 0.0, True, {}

    def close(self):
        seen = self.saw_token.wait(10)
        self.path.write_text("closed after the step saw its token" if seen else "closed; the token never reached the step")


class Echo:
    def reset(self, row):
        return [{"role": "system", "content": f"echo {row['prompt']}"}]

    def step(self, action_text):
        return f"you said {action_text}", 1.0, action_text == "bye", {"pid": os.getpid()}

    def close(self):
        pass


class AsyncEcho:
    async def reset(self, row):
        await asyncio.sleep(0)
        return "hello"

    async def step(self, action_text, token):
        return action_text.upper(), None, token.cancelled, None

    async def close(self):
        pass


class Flaky(Echo):
    def step(self, action_text):
        raise TransientEnvironmentError("the sandbox is busy")


class Broken(Echo):
    def step(self, action_text):
        raise ValueError(f"cannot parse {action_text!r}")


class Dies(Echo):
    """Starts a `sleep` child in reset, then its worker exits in step."""

    def reset(self, row):
        Path(row["pids"]).write_text(str(subprocess.Popen(["sleep", "600"]).pid))
        return super().reset(row)

    def step(self, action_text):
        os._exit(7)


class BadShape(Echo):
    def step(self, action_text):
        return "only an observation"


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first, then ppid, pgrp), or None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie does no work; init reaps it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


async def until(predicate, timeout_s: float = 20.0) -> None:
    """Wait (bounded) for something another process does."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_cancel_kills_an_environment_that_ignores_the_token_and_everything_it_started(tmp_path):
    ticks, pids = tmp_path / "ticks", tmp_path / "pids"

    async def main():
        host = ProcessHost(f"{HERE}:Stubborn", "user")
        assert await host.reset({"path": str(ticks), "pids": str(pids)}) == ({"role": "user", "content": "ready"},)
        worker, sleeper = map(int, pids.read_text().split())
        step = asyncio.create_task(host.step("go"))
        await until(lambda: lines(ticks) >= 5)  # the step is running
        assert await host.cancel(grace_s=0.3) is True
        after_cancel = lines(ticks)
        with pytest.raises(EpisodeCancelled):
            await step
        return worker, sleeper, after_cancel, host

    worker, sleeper, after_cancel, host = asyncio.run(main())
    assert host.pid == worker and host._proc.returncode == -signal.SIGKILL  # it could not stop by itself: it was killed
    assert not alive(sleeper) and group_members(worker) == []  # the process it started went with its group
    time.sleep(0.1)
    assert lines(tmp_path / "ticks") == after_cancel  # the side effect stopped moving when cancel returned


def test_a_cancel_cut_short_by_its_own_cancellation_still_ends_the_worker_and_closes_its_transport(tmp_path):
    """asyncio.run cancels what is still running when a run ends: a cancel() cut short in its grace wait used to leave
    the worker and its children running until garbage collection, and its transport unclosed (a ResourceWarning)."""
    ticks, pids = tmp_path / "ticks", tmp_path / "pids"

    async def main():
        host = ProcessHost(f"{HERE}:Stubborn", "user")
        await host.reset({"path": str(ticks), "pids": str(pids)})
        worker, sleeper = map(int, pids.read_text().split())
        step = asyncio.create_task(host.step("go"))
        await until(lambda: lines(ticks) >= 5)
        stopping = asyncio.create_task(host.cancel(grace_s=60))
        await until(lambda: host._proc.writer.is_closing())  # the cancel is in its grace wait
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        with pytest.raises(EpisodeCancelled):
            await step
        await until(lambda: group_members(worker) == [] and not alive(sleeper))  # not left to the garbage collector
        return weakref.ref(host), worker

    gc.collect()  # earlier tests' garbage: only this test's worker is looked for below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        host, worker = asyncio.run(main())
        gc.collect()
    assert host() is None
    assert [str(w.message) for w in caught if w.category is ResourceWarning and str(worker) in str(w.message)] == []


def test_cancel_of_a_cooperative_environment_sets_its_token_and_calls_close_in_the_worker(tmp_path):
    mark = tmp_path / "mark"

    async def main():
        host = ProcessHost(f"{HERE}:Cooperative", "user")
        assert await host.reset({"path": str(mark)}) == ()
        step = asyncio.create_task(host.step("go"))
        await until(lambda: mark.exists())
        assert await host.cancel(grace_s=30) is True
        with pytest.raises(EpisodeCancelled):
            await step
        return host

    host = asyncio.run(main())
    assert host._proc.returncode == 0  # it stopped within the grace: no kill was needed
    assert mark.read_text() == "closed after the step saw its token"


def test_an_episode_runs_reset_steps_and_close_in_one_worker_process():
    async def main():
        host = ProcessHost(f"{HERE}:Echo", "user")
        first = await host.reset({"prompt": "hi"})
        a = await host.step("more")
        b = await host.step("bye")
        await host.close()
        await host.close()  # idempotent
        return host, first, a, b

    host, first, a, b = asyncio.run(main())
    assert first == ({"role": "system", "content": "echo hi"},)
    assert a.messages == ({"role": "user", "content": "you said more"},) and a.reward == 1.0 and not a.done
    assert b.done and a.info["pid"] == b.info["pid"] == host.pid != os.getpid()
    assert host._proc.returncode == 0 and group_members(host.pid) == []


def test_async_methods_run_on_the_workers_event_loop_and_receive_the_token():
    async def main():
        host = ProcessHost(f"{HERE}:AsyncEcho", "tool")
        assert await host.reset({}) == ({"role": "tool", "content": "hello"},)
        result = await host.step("abc")
        await host.close()
        return result

    result = asyncio.run(main())
    assert result.messages == ({"role": "tool", "content": "ABC"},) and result.reward is None and result.done is False


@pytest.mark.parametrize(
    ("env", "error", "says"),
    [
        ("Flaky", TransientEnvironmentError, "TransientEnvironmentError: the sandbox is busy"),
        ("Broken", RemoteEnvironmentError, "ValueError: cannot parse 'go'"),
    ],
)
def test_what_the_environment_raised_comes_back_classified_with_its_traceback(env, error, says):
    async def main():
        host = ProcessHost(f"{HERE}:{env}", "user")
        await host.reset({"prompt": "x"})
        with pytest.raises(Exception) as caught:
            await host.step("go")
        with pytest.raises(error):  # the worker still serves after an error
            await host.step("again")
        await host.close()
        return caught.value

    exc = asyncio.run(main())
    assert type(exc) is error and says in str(exc)
    assert isinstance(exc.__cause__, RemoteTraceback) and "in step" in str(exc.__cause__)  # the worker's traceback
    if error is RemoteEnvironmentError:
        assert exc.remote_type == "ValueError" and not isinstance(exc, TransientEnvironmentError)


def test_a_cancel_while_the_worker_is_starting_stops_it_once_started():
    async def main():
        host = ProcessHost(f"{HERE}:Echo", "user")
        reset = asyncio.create_task(host.reset({"prompt": "x"}))
        await asyncio.sleep(0)  # reset is starting the worker
        assert await host.cancel(grace_s=0.1) is True
        with pytest.raises(EpisodeCancelled):
            await reset
        return host

    host = asyncio.run(main())
    assert host.pid is not None and group_members(host.pid) == []  # the worker that started late was stopped


def test_a_worker_that_dies_fails_the_call_instead_of_hanging_and_takes_what_it_started_with_it(tmp_path):
    async def main():
        host = ProcessHost(f"{HERE}:Dies", "user")
        await host.reset({"prompt": "x", "pids": str(tmp_path / "pids")})
        sleeper = int((tmp_path / "pids").read_text())
        with pytest.raises(EnvironmentProcessDied) as caught:
            await host.step("go")
        await until(lambda: not alive(sleeper))  # its group is killed when its exit is seen, before any close
        await host.close()
        return host, caught.value

    host, exc = asyncio.run(main())
    assert "exit code 7" in str(exc) and "during step" in str(exc)
    assert group_members(host.pid) == []


def test_a_wrong_step_shape_and_a_wrong_factory_name_are_errors_that_say_so():
    async def main():
        host = ProcessHost(f"{HERE}:BadShape", "user")
        await host.reset({"prompt": "x"})
        with pytest.raises(TypeError, match="step must return"):
            await host.step("go")
        await host.close()
        missing = ProcessHost(f"{HERE}:NoSuchEnv", "user")
        with pytest.raises(RemoteEnvironmentError) as caught:
            await missing.reset({})
        return missing, caught.value

    missing, exc = asyncio.run(main())
    assert exc.remote_type == "ConfigError" and "has no attribute 'NoSuchEnv'" in str(exc)
    assert group_members(missing.pid) == []


def test_a_parent_that_exits_without_closing_leaves_no_process_behind(tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio
        from asyncgrpo.environments.process_host import ProcessHost

        async def main():
            host = ProcessHost("{HERE}:Stubborn", "user")
            await host.reset({{"path": {str(tmp_path / "ticks")!r}, "pids": {str(tmp_path / "pids")!r}}})
            asyncio.create_task(host.step("go"))
            while not __import__("os").path.exists({str(tmp_path / "ticks")!r}):
                await asyncio.sleep(0.01)
            globals()["kept"] = host  # never closed: only the finalizer at interpreter exit can end it

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], timeout=50)
    assert done.returncode == 0
    worker, sleeper = map(int, (tmp_path / "pids").read_text().split())

    async def gone():
        await until(lambda: not alive(worker) and not alive(sleeper))

    asyncio.run(gone())
    assert group_members(worker) == []
