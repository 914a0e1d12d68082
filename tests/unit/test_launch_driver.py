"""The launch driver (generation/launch.py `ServerLauncher`) over a scripted stand-in for Ray: what it does with what
its actors answer. A server that fails to start fails the start with the class its failure names (ConfigError for a
missing program, BackendDeadError otherwise) and every actor is stopped and killed; a server whose actor dies gets a
new actor whose URL replaces the old one in the pool, from the same restart budget as its process's restarts; past
the budget (or when the new actor does not start) it stays down and the pool is told why. The real actors and Ray are
tests/integration's (test_launch_actor.py, test_ray_launch.py)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from asyncgrpo.config import load_config
from asyncgrpo.errors import BackendDeadError, ConfigError
from asyncgrpo.generation import launch as launch_module
from asyncgrpo.generation.launch import ServerLauncher
from asyncgrpo.generation.launch_actor import LaunchFailure, LaunchSpec, ServerExit
from asyncgrpo.sync import StateSignal
from tests.bounded import run_bounded

LAUNCH = ("runtime=ray", "generation.backend=http", "generation.http.launch.count=2")


class RayError(Exception):
    """Stands for ray.exceptions.RayError (ActorDiedError is one)."""


class Method:
    def __init__(self, function: Any) -> None:
        self.function = function

    def remote(self, *args: Any) -> Any:
        return self.function(*args)


class Actor:
    """One actor: `start` answers `answer`; `exited(seen)` waits for the test to `exit_` its server or `die`."""

    def __init__(self, ray: FakeRay, spec: LaunchSpec, answer: str | LaunchFailure) -> None:
        self.ray, self.spec, self.answer = ray, spec, answer
        self.exits: list[ServerExit] = []
        self.died = False
        self.stopped = False
        self.unkillable = False  # ray.kill raises on it
        self.start, self.exited, self.stop = Method(self._start), Method(self._exited), Method(self._stop)

    async def _start(self) -> str | LaunchFailure:
        return self.answer

    async def _exited(self, seen: int) -> ServerExit | None:
        await self.ray.signal.wait_for(lambda: self.died or self.stopped or len(self.exits) > seen)
        if len(self.exits) > seen:  # reported before its death
            return self.exits[-1]
        if self.died:
            raise RayError("The actor died unexpectedly before finishing this task.")
        return None

    async def _stop(self) -> None:
        self.stopped = True
        self.ray.signal.notify()

    def exit_(self, restarts_left: int) -> None:
        self.exits.append(ServerExit(len(self.exits) + 1, -9, restarts_left >= 0, max(restarts_left, 0), "killed"))
        self.ray.signal.notify()

    def die(self) -> None:
        self.died = True
        self.ray.signal.notify()


class FakeRay:
    """What launch.py asks of the `ray` module; each new actor answers the next of `answers` (then URLs)."""

    class exceptions:  # noqa: N801 - as in ray
        RayError = RayError

    def __init__(self, answers: list[str | LaunchFailure]) -> None:
        ports = itertools.count(9000)
        self.answers = itertools.chain(answers, (f"http://node:{port}" for port in ports))
        self.actors: list[Actor] = []
        self.killed: list[Actor] = []
        self.signal = StateSignal()

    def remote(self, _cls: Any) -> FakeRay:
        return self

    def options(self, **_options: Any) -> Method:
        return Method(self._new_actor)

    def _new_actor(self, spec: LaunchSpec) -> Actor:
        actor = Actor(self, spec, next(self.answers))
        self.actors.append(actor)
        return actor

    def kill(self, actor: Actor, no_restart: bool) -> None:
        assert no_restart
        if actor.unkillable:
            raise RayError(f"could not kill actor {actor.spec.name}: its node does not answer")
        self.killed.append(actor)

    def available_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}


class Cluster:
    async def connect(self) -> None:
        pass

    async def disconnect(self) -> None:
        pass


class Slots:
    """The pool's side (`ServerSlots`): records what it is told."""

    def __init__(self, signal: StateSignal) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.signal = signal

    def replace_server(self, position: int, url: str, why: str) -> None:
        self.calls.append(("replace", position, url))
        self.signal.notify()

    def server_gone(self, position: int, why: str) -> None:
        self.calls.append(("gone", position, why))
        self.signal.notify()


def launcher(monkeypatch, tmp_path, answers: list[str | LaunchFailure], *overrides: str) -> tuple[ServerLauncher, FakeRay]:
    ray = FakeRay(answers)
    monkeypatch.setattr(launch_module, "import_ray", lambda: ray)
    server_launcher = ServerLauncher(load_config(None, [*LAUNCH, *overrides]), tmp_path)
    server_launcher._cluster = Cluster()  # type: ignore[assignment]
    return server_launcher, ray


def run(coro: Any) -> Any:
    return run_bounded(coro, 30)


@pytest.mark.parametrize(("kind", "error"), [("start", BackendDeadError), ("config", ConfigError)])
def test_a_server_that_fails_to_start_fails_the_start_with_its_message_and_every_actor_is_stopped_and_killed(
        monkeypatch, tmp_path, kind, error):
    failure = LaunchFailure(kind, "server server-1 (serve MODEL) exited with code 3 while starting. Fix: see the log")
    server_launcher, ray = launcher(monkeypatch, tmp_path, ["http://node:1", failure])
    with pytest.raises(error) as info:
        run(server_launcher.start())
    assert failure.message in str(info.value)
    assert all(actor.stopped for actor in ray.actors) and ray.killed == ray.actors and len(ray.actors) == 2


def test_a_dead_actor_is_replaced_on_a_new_url_from_the_same_budget_as_process_restarts_then_stays_down(
        monkeypatch, tmp_path):
    server_launcher, ray = launcher(monkeypatch, tmp_path, [], "generation.http.launch.max_restarts=2")
    slots = Slots(ray.signal)

    async def scenario() -> list[Actor]:
        urls = await server_launcher.start()
        assert urls == ["http://node:9000", "http://node:9001"]
        server_launcher.watch(slots, first=3)  # two servers of base_urls, say, and one more before
        first = ray.actors[0]
        first.exit_(restarts_left=1)  # its process exited; its actor restarted it: one restart spent
        first.die()
        await ray.signal.wait_for(lambda: len(slots.calls) == 1)
        assert slots.calls == [("replace", 3, "http://node:9002")] and server_launcher.urls[0] == "http://node:9002"
        second = ray.actors[2]
        assert first in ray.killed and second.spec.max_restarts == 0  # what is left of the budget is the new process's
        second.die()
        await ray.signal.wait_for(lambda: len(slots.calls) == 2)
        await server_launcher.aclose()
        return [first, second]

    first, second = run(scenario())
    gone = slots.calls[1]
    assert gone[:2] == ("gone", 3) and "launched server server-0 stays down" in gone[2]
    assert "its actor died (RayError); generation.http.launch.max_restarts = 2 spent" in gone[2]
    assert len(ray.actors) == 3 and set(ray.killed) == set(ray.actors)  # no more actors; all of them killed at the end


def test_a_replacement_that_does_not_start_leaves_the_server_down_naming_why(monkeypatch, tmp_path):
    failure = LaunchFailure("start", "server server-1 did not answer GET /health within start_timeout_s = 300 s")
    server_launcher, ray = launcher(monkeypatch, tmp_path, ["http://node:1", "http://node:2", failure])
    slots = Slots(ray.signal)

    async def scenario() -> None:
        await server_launcher.start()
        server_launcher.watch(slots, first=0)
        ray.actors[1].die()
        await ray.signal.wait_for(lambda: len(slots.calls) == 1)
        await server_launcher.aclose()

    run(scenario())
    (what, position, why), = slots.calls
    assert (what, position) == ("gone", 1) and "its replacement did not start: " + failure.message in why


def test_a_dead_actor_that_cannot_be_killed_gets_no_replacement_and_its_server_stays_down_naming_why(monkeypatch, tmp_path):
    # Killed for sure first, or no other actor takes its place (a merely unreachable one may serve on); the watcher says so
    # and ends, instead of ending on the kill's exception with nobody told.
    server_launcher, ray = launcher(monkeypatch, tmp_path, [])
    slots = Slots(ray.signal)

    async def scenario() -> None:
        await server_launcher.start()
        server_launcher.watch(slots, first=0)
        ray.actors[0].unkillable = True
        ray.actors[0].die()
        await ray.signal.wait_for(lambda: len(slots.calls) == 1)
        watcher = server_launcher._watchers[0]
        await asyncio.wait([watcher], timeout=5)
        assert watcher.done() and watcher.exception() is None  # it ended saying why, not on the kill's exception
        await server_launcher.aclose()  # its kill fails again: said, and the rest of the close goes on

    run(scenario())
    (what, position, why), = slots.calls
    assert (what, position) == ("gone", 0) and len(ray.actors) == 2  # no replacement started
    assert "its dead actor could not be killed for sure within 30 s (RayError: could not kill actor server-0" in why


def test_a_watcher_that_fails_unexpectedly_leaves_its_server_down_naming_why(monkeypatch, tmp_path):
    server_launcher, ray = launcher(monkeypatch, tmp_path, [])
    slots = Slots(ray.signal)

    def refused(**_options: Any) -> Method:
        raise ValueError("placement group bundle 0 was removed")

    async def scenario() -> None:
        await server_launcher.start()
        server_launcher.watch(slots, first=0)
        ray.options = refused  # type: ignore[method-assign]  # the replacement actor cannot be created
        ray.actors[0].die()
        await ray.signal.wait_for(lambda: len(slots.calls) == 1)
        await server_launcher.aclose()

    run(scenario())
    (what, position, why), = slots.calls
    assert (what, position) == ("gone", 0)
    assert "watching it failed: ValueError: placement group bundle 0 was removed" in why
