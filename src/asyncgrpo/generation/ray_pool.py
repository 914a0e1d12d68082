"""`RayGenerator`: the `Generator` protocol over generator actors on a Ray cluster (`runtime: ray`).

Job: run `ray.generators` in-process engines (`LocalEngine`) as Ray actors, each on its own copy
of the weights, and present them to the collector as one generator, so the collector, the
failure policy and every DESIGN invariant work as with any other backend.

Design and invariants:
- **Actors.** `start()` connects to Ray (ray_cluster.py), reserves their placement group when
  `ray.generator.placement` asks for one (ray_placement.py), puts the model and tokenizer into the
  object store once and creates the actors (`ray.generator.num_cpus` / `num_gpus` each, the engine on
  `actor_device`: a reserved GPU or the CPU; restarted up to `ray.max_restarts` times), then waits
  until every one has built its engine, within
  `ray.startup_timeout_s` (a cluster without the resources asked for never places an actor: the
  error says what was asked and what the cluster has).
- **Dispatch.** A request goes to the usable actor with the fewest open requests, except that the requests of one
  session (the same `request.affinity`: an agent's turns) go to the actor its first request went to while that one
  is usable; a session whose actor cannot take work moves to another, pinned there from then on (counted in
  `session_moves`, logged; each turn carries the whole conversation as ids). Pins are held weakly. Cancelling
  `generate` cancels the actor's task (`ray.cancel`), which cancels the engine request, so the
  sequence leaves its batch.
- **Versions.** `required` is the last version `load_weights` installed. Every request carries it,
  and an actor serving older weights refuses the request without running it: it restarted with
  its constructor's weights. The actor is then recovered and the request goes to another actor;
  a refusal is no failure. `serving_version` is the lowest version among usable actors (the
  published one while none is usable); completions carry the versions the engine stamped.
- **Faults.** A request whose actor dies (`RayActorError`) raises `TransientGenerationError`: the
  collector retries it under the normal policy (on another actor), and a group whose rollouts
  all fail counts in the failure streak as for any backend. The actor is marked lost and
  recovered by its own task: the newest weights are installed (Ray holds the call while the
  actor restarts; a call refused as unavailable is retried with backoff), and only then does it
  take work again. `ActorDiedError` (restarts spent) marks it dead for good. With no usable
  actor, `generate` and `load_weights` wait on a `StateSignal` predicate and raise
  `BackendDeadError` (naming every actor and its last error) after
  `generation.backend_dead_after_s`, at once when every actor is dead for good.
- **Weights.** `load_weights(state, version)` puts `state` into the object store once (`ray.put`;
  a `StoredWeights` is there already: its reference is used) and installs the reference on every
  usable actor concurrently, one install per actor at a time
  (a per-actor lock); an actor that dies meanwhile is recovered at the newest version. It returns
  once at least one actor serves `version`. `state=None`: same weights, the version advances.
- **Lifecycle.** `aclose` cancels the recoveries, kills the actors and disconnects from Ray
  (bounded, idempotent); requests still open fail: cancel them first.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asyncgrpo.config import Config
from asyncgrpo.errors import BackendDeadError, GenerationError, TransientGenerationError
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.generation.ray_cluster import RayCluster, import_ray
from asyncgrpo.generation.ray_placement import RolePlacement
from asyncgrpo.generation.ray_weights import StoredWeights
from asyncgrpo.generation.session_pins import SessionPins
from asyncgrpo.sync import StateSignal
from asyncgrpo.threads import run_in_daemon_thread
from asyncgrpo.types import Completion, GenerationRequest

log = logging.getLogger("asyncgrpo")

_RECOVERY_RETRY_S = (0.05, 1.0)  # first and largest delay between installs refused while an actor restarts
_KILL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Refused:
    """An actor's answer to a request it did not run: it serves `version`, older than the request needs."""

    version: int


def actor_device(spec: str, num_gpus: float) -> str:
    """Where each generator actor's engine runs: ``generation.local.device``, where `auto` is the GPU Ray reserved for
    the actor when ``ray.generator.num_gpus`` > 0 (Ray makes it the actor's visible device, ``cuda``), else the CPU: an
    actor must not take a GPU it was not given."""
    if spec != "auto":
        return spec
    return "cuda" if num_gpus > 0 else "cpu"


class GeneratorActor:
    """One generator actor's body: a `LocalEngine` over its own copy of the model (Ray makes it an async actor).

    Errors of a request come back as values (the exception), so the driver re-raises them as the
    same class; a restarted actor starts its engine on its first call."""

    def __init__(self, model: Any, tokenizer: Any, version: int, max_batch_size: int, name: str, device: str) -> None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.startswith("cuda") and (torch.device(device).index or 0) >= visible:
            raise GenerationError(
                f"generator actor {name}: generation.local.device resolves to {device!r} here, but the actor sees "
                f"{visible} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): Ray shows an "
                f"actor only the GPUs it reserved, numbered from 0. Fix: give the actors GPUs (ray.generator.num_gpus) and "
                f"set generation.local.device: auto or cuda, or set it to cpu."
            )
        self._engine = LocalEngine(model.to(device), tokenizer, name=name, max_batch_size=max_batch_size, version=version)
        self._open = 0  # requests this actor holds (running or queued in its engine)
        self._open_changed = StateSignal()

    async def ready(self) -> int:
        await self._engine.start()
        return os.getpid()

    async def generate(self, request: GenerationRequest, required_version: int) -> Completion | Refused | Exception:
        await self._engine.start()
        if self._engine.serving_version < required_version:
            return Refused(self._engine.serving_version)
        self._open += 1
        self._open_changed.notify()
        try:
            return await self._engine.generate(request)
        except (GenerationError, ValueError) as exc:
            return exc
        finally:
            self._open -= 1
            self._open_changed.notify()

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> int:
        await self._engine.start()
        if version > self._engine.serving_version:
            await self._engine.load_weights(state, version)
        return self._engine.serving_version

    async def holding(self, count: int, timeout_s: float) -> int:
        """Wait until this actor holds at least `count` requests (TimeoutError after `timeout_s`); returns how many.
        Ray starts an async actor's tasks in no guaranteed order: tests synchronise on this."""
        async with asyncio.timeout(timeout_s):
            await self._open_changed.wait_for(lambda: self._open >= count)
        return self._open

    async def stats(self) -> dict[str, int]:
        return {**self._engine.stats(), "open_requests": self._open, "pid": os.getpid()}


@dataclass(eq=False)
class _Actor:
    name: str
    handle: Any
    version: int
    state: Literal["ready", "lost", "dead"] = "ready"
    outstanding: int = 0
    dispatched: int = 0
    failures: int = 0
    last_error: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    recovery: asyncio.Task | None = None

    def describe(self) -> str:
        state = {"ready": f"serving version {self.version}", "lost": "restarting", "dead": "dead (restarts spent)"}[self.state]
        last = f"; last error: {self.last_error}" if self.last_error else ""
        return f"{self.name}: {state}{last}"


class RayGenerator:
    """`Generator` over `cfg.ray.generators` actors; see the module docstring.

    `model` and `tokenizer` are the generators' copy (the caller hands them over and must not
    change them); `version` is the version of those weights.
    """

    # rollout.on_stale: resume: each actor's engine installs weights between decoding steps and stamps each token with its
    # version (as the local engine does), so a rollout continues in place; one whose actor dies is retried from its start.
    continues_in_flight = True

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, *, version: int = 0, name: str = "ray") -> None:
        self.name = name
        self.cfg = cfg
        self._model, self._tokenizer = model, tokenizer
        self._cluster = RayCluster(cfg.ray, timeout_s=cfg.run.shutdown_timeout_s)
        self._placement = RolePlacement(cfg.ray.generator, cfg.ray.generators, key="ray.generator")
        self._actors: list[_Actor] = []
        self._initial_version = version
        self._required = version  # the last version installed by load_weights
        self._latest: tuple[Any, int] = (None, version)  # newest (state reference or None for the initial weights, version)
        self._signal = StateSignal()
        self._constructor_refs: tuple[Any, ...] = ()
        self._started = False
        self._closed = False
        self.counters = {"actor_failures": 0, "recoveries": 0, "refusals": 0}
        self._pins: SessionPins[_Actor] = SessionPins(name, self.counters, "actor")

    # ------------------------------------------------------------------ views

    @property
    def serving_version(self) -> int:
        ready = [a.version for a in self._actors if a.state == "ready"]
        return min(ready) if ready else self._required

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "serving_version": self.serving_version,
            "published_version": self._required,
            "actors": [{"name": a.name, "state": a.state, "version": a.version, "outstanding": a.outstanding,
                        "dispatched": a.dispatched, "failures": a.failures, "last_error": a.last_error} for a in self._actors],
        }

    @property
    def actor_handles(self) -> list[Any]:
        """The actors' Ray handles, in order (tests kill them with `ray.kill`)."""
        return [a.handle for a in self._actors]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._closed:
            raise GenerationError(f"Ray generator {self.name!r} is closed; create a new one.", backend=self.name)
        if self._started:
            return
        await self._cluster.connect()
        try:
            await self._create_actors()
        except BaseException:
            await self._teardown()
            raise
        self._started = True

    async def _create_actors(self) -> None:
        ray = import_ray()
        rc = self.cfg.ray
        actor_class = ray.remote(GeneratorActor)
        options = {"num_cpus": rc.generator.num_cpus, "num_gpus": rc.generator.num_gpus, "max_restarts": rc.max_restarts,
                   "max_task_retries": 0}
        try:
            await self._placement.reserve(rc.startup_timeout_s)
        except TimeoutError:
            raise BackendDeadError(self._placement_problem(ray), backend=self.name) from None
        model_ref, tokenizer_ref = await run_in_daemon_thread(lambda: (ray.put(self._model), ray.put(self._tokenizer)),
                                                              name="asyncgrpo-ray-put")
        # The object store holds them now. The references are kept: a restarted actor is built from them again
        # (Ray deletes an object once no reference to it is left, and then no restart could succeed).
        self._model = self._tokenizer = None
        self._constructor_refs = (model_ref, tokenizer_ref)
        batch = self.cfg.generation.local.max_batch_size
        device = actor_device(self.cfg.generation.local.device, rc.generator.num_gpus)
        for index in range(rc.generators):
            name = f"{self.name}-{index}"
            remote = actor_class.options(**options, **self._placement.options(index))
            handle = remote.remote(model_ref, tokenizer_ref, self._initial_version, batch, name, device)
            self._actors.append(_Actor(name, handle, self._initial_version))
        try:
            async with asyncio.timeout(rc.startup_timeout_s):
                for actor in self._actors:
                    await self._started_actor(actor)
        except TimeoutError:
            raise BackendDeadError(self._placement_problem(ray), backend=self.name) from None

    async def _started_actor(self, actor: _Actor) -> None:
        ray = import_ray()
        try:
            await actor.handle.ready.remote()
        except ray.exceptions.RayError as exc:
            raise GenerationError(f"generator actor {actor.name} failed to start: {exc}", backend=self.name) from exc

    def _placement_problem(self, ray: Any) -> str:
        rc = self.cfg.ray
        try:
            available = ray.available_resources()
        except Exception as exc:  # noqa: BLE001 - only for the message
            available = f"unknown ({exc})"
        return (
            f"the {rc.generators} generator actors were not all placed and started within ray.startup_timeout_s = "
            f"{rc.startup_timeout_s:g} s. Each asks for ray.generator.num_cpus = {rc.generator.num_cpus:g} and "
            f"ray.generator.num_gpus = {rc.generator.num_gpus:g} ({self._placement.describe()}); the cluster has free: "
            f"{available}. Fix: lower "
            f"ray.generators or the per-actor resources, give the cluster more nodes, or raise ray.startup_timeout_s "
            f"if building the engines is slow."
        )

    async def aclose(self) -> None:
        """Cancel recoveries, kill the actors and let go of Ray. Bounded and idempotent."""
        self._closed = True
        self._signal.notify()
        await self._teardown()

    async def _teardown(self) -> None:
        recoveries = [a.recovery for a in self._actors if a.recovery is not None]
        for task in recoveries:
            task.cancel()
        if recoveries:
            await asyncio.wait(recoveries)
        actors, self._actors = self._actors, []
        self._constructor_refs = ()
        self._latest = (None, self._latest[1])
        try:
            if actors:
                ray = import_ray()
                async with asyncio.timeout(_KILL_TIMEOUT_S):
                    await run_in_daemon_thread(lambda: [ray.kill(a.handle, no_restart=True) for a in actors],
                                               name="asyncgrpo-ray-kill")
        except TimeoutError:
            raise GenerationError(f"killing the generator actors did not return within {_KILL_TIMEOUT_S:g} s; they may be "
                                  f"left running on the cluster (`ray list actors` shows them).", backend=self.name) from None
        finally:
            await self._placement.release()
            await self._cluster.disconnect()

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> Completion:
        ray = import_ray()
        while True:
            actor = await self._actor_for(request)
            ref = actor.handle.generate.remote(request, self._required)
            actor.outstanding += 1
            actor.dispatched += 1
            try:
                result = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except ray.exceptions.RayActorError as exc:
                self._lose(actor, f"request {request.request_id}: {type(exc).__name__}")
                raise TransientGenerationError(
                    f"request {request.request_id}: generator actor {actor.name} died or restarted while it held the "
                    f"request ({type(exc).__name__}); it is retried on another actor.", backend=self.name) from exc
            except ray.exceptions.RayError as exc:  # our actor code raised: a bug, not a backend hiccup
                raise GenerationError(f"request {request.request_id}: generator actor {actor.name} failed: {exc}",
                                      backend=self.name) from exc
            finally:
                actor.outstanding -= 1
            if isinstance(result, Refused):  # it restarted with its first weights: recover it, ask another
                self.counters["refusals"] += 1
                self._lose(actor, f"restarted: serves version {result.version}, requests need {self._required}")
                continue
            if isinstance(result, GenerationError):
                raise type(result)(f"{actor.name}: {result}", backend=self.name)
            if isinstance(result, Exception):
                raise type(result)(f"{actor.name}: {result}")
            return result

    async def _actor_for(self, request: GenerationRequest) -> _Actor:
        """A usable actor for `request`: its session's while that one is usable; else the one with the fewest open
        requests, which its session (if any) is pinned to from then on."""
        actor = await self._acquire(lambda a: True, "generate", prefer=self._pins.preferred(request.affinity))
        self._pins.chosen(request.affinity, actor, actor.name)
        return actor

    async def _acquire(self, ready: Any, what: str, *, prefer: _Actor | None = None) -> _Actor:
        """The usable actor (state ready and `ready(actor)`): `prefer` if it is one, else the one with the fewest open
        requests; waits for one."""
        if self._closed or not self._started:
            state = "closed" if self._closed else "not started: await start() first"
            raise GenerationError(f"Ray generator {self.name!r} is {state}.", backend=self.name)

        def usable() -> list[_Actor]:
            return [a for a in self._actors if a.state == "ready" and ready(a)]

        def settled() -> bool:
            return self._closed or bool(usable()) or all(a.state == "dead" for a in self._actors)

        try:
            async with asyncio.timeout(self.cfg.generation.backend_dead_after_s):
                await self._signal.wait_for(settled)
        except TimeoutError:
            raise BackendDeadError(self._dead_message(what, "for generation.backend_dead_after_s = "
                                                      f"{self.cfg.generation.backend_dead_after_s:g} s"), backend=self.name) from None
        candidates = usable()
        if self._closed:
            raise GenerationError(f"Ray generator {self.name!r} closed during {what}.", backend=self.name)
        if not candidates:
            raise BackendDeadError(self._dead_message(what, "any more: every actor spent its ray.max_restarts"), backend=self.name)
        return prefer if prefer in candidates else min(candidates, key=lambda a: a.outstanding)

    def _dead_message(self, what: str, how_long: str) -> str:
        return (
            f"{what}: no generator actor could take work {how_long}. Actors: "
            + "; ".join(a.describe() for a in self._actors)
            + f". Fix: see why they died (Ray's worker logs, `ray logs`), and raise ray.max_restarts (now "
            f"{self.cfg.ray.max_restarts}) if actors die now and then."
        )

    async def settled(self) -> None:
        """Wait until no actor is being recovered (each serves, or is dead for good), within
        generation.backend_dead_after_s (then BackendDeadError)."""
        try:
            async with asyncio.timeout(self.cfg.generation.backend_dead_after_s):
                await self._signal.wait_for(lambda: self._closed or all(a.state != "lost" for a in self._actors))
        except TimeoutError:
            raise BackendDeadError(self._dead_message("waiting for recoveries", "for generation.backend_dead_after_s = "
                                                      f"{self.cfg.generation.backend_dead_after_s:g} s"), backend=self.name) from None

    # ------------------------------------------------------------------ weights and recovery

    async def load_weights(self, state: Mapping[str, Any] | None, version: int) -> None:
        if version < self._latest[1]:
            raise ValueError(f"load_weights: version {version} is older than version {self._latest[1]} already published; "
                             f"versions must not decrease.")
        await self._acquire(lambda a: True, f"publishing weights of version {version}")
        ref = self._latest[0]
        if isinstance(state, StoredWeights):  # already in the object store (a trainer on Ray): the actors read it there
            ref = state.ref
        elif state is not None:
            ray = import_ray()
            ref = await run_in_daemon_thread(lambda: ray.put(dict(state)), name="asyncgrpo-ray-put")
        self._latest = (ref, version)
        try:
            async with asyncio.TaskGroup() as group:
                for actor in self._actors:
                    if actor.state == "ready":
                        group.create_task(self._install_or_lose(actor))
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        await self._acquire(lambda a: a.version >= version, f"publishing weights of version {version}")
        self._required = max(self._required, version)
        self._signal.notify()

    async def _install(self, actor: _Actor) -> None:
        """Install the newest weights on `actor` (Ray errors and TimeoutError propagate), again while newer ones
        were published meanwhile. The actor answers the version it serves; it skips a load it already has."""
        async with actor.lock:
            while True:
                ref, version = self._latest
                async with asyncio.timeout(self.cfg.generation.weight_sync_timeout_s):
                    actor.version = await actor.handle.load_weights.remote(ref, version)
                if actor.version >= self._latest[1]:
                    return

    async def _install_or_lose(self, actor: _Actor) -> None:
        ray = import_ray()
        try:
            await self._install(actor)
        except ray.exceptions.RayActorError as exc:
            self._lose(actor, f"weight install: {type(exc).__name__}")
        except TimeoutError:
            self._lose(actor, f"weight install took longer than generation.weight_sync_timeout_s = "
                              f"{self.cfg.generation.weight_sync_timeout_s:g} s")
        self._signal.notify()

    def _lose(self, actor: _Actor, why: str) -> None:
        """Take `actor` out of work and start its recovery (once)."""
        if actor.state == "dead" or self._closed:
            return
        if actor.state == "ready":
            actor.failures += 1
            self.counters["actor_failures"] += 1
            log.warning("warning: generator actor %s lost (%s); recovering it", actor.name, why)
        actor.state, actor.last_error = "lost", why
        if actor.recovery is None or actor.recovery.done():
            actor.recovery = asyncio.create_task(self._recover(actor), name=f"{actor.name}-recovery")
        self._signal.notify()

    async def _recover(self, actor: _Actor) -> None:
        """Install the newest weights on a lost actor until it takes them (then it is ready) or is dead for good."""
        ray = import_ray()
        delay = _RECOVERY_RETRY_S[0]
        while True:
            try:
                await self._install(actor)
            except ray.exceptions.ActorDiedError as exc:
                actor.state, actor.last_error = "dead", f"{type(exc).__name__}: {exc}"
                self._signal.notify()
                return
            except (ray.exceptions.RayActorError, TimeoutError) as exc:
                actor.last_error = f"recovery: {type(exc).__name__}"
                await asyncio.sleep(delay)  # it is restarting: nothing to wait on but time
                delay = min(delay * 2, _RECOVERY_RETRY_S[1])
                continue
            except Exception as exc:  # noqa: BLE001 - recorded on the actor; BackendDeadError names it
                actor.state, actor.last_error = "dead", f"recovery failed: {type(exc).__name__}: {exc}"
                self._signal.notify()
                return
            actor.state = "ready"
            self.counters["recoveries"] += 1
            log.warning("warning: generator actor %s recovered at version %d", actor.name, actor.version)
            self._signal.notify()
            return
