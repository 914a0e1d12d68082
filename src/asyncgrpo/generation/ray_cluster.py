"""`RayCluster`: this process's connection to Ray for one run: join a cluster or start a local one, then let go.

Job: `connect()` joins `ray.address`, or (address null) starts a fresh local cluster of
`ray.num_cpus` CPUs without the dashboard; `disconnect()` undoes exactly what `connect()` did.

Invariants:
- A process already connected (`ray.is_initialized()`, e.g. a test session's cluster or a user's
  own `ray.init`) is used as it is and left connected: whoever connected it disconnects it.
- `disconnect()` is bounded by `timeout_s` (run.shutdown_timeout_s) and idempotent. For a local
  cluster it stops every Ray process this run started (`ray.shutdown`); a joined cluster keeps
  running, and the run's actors (not detached) end with this driver.
- A local cluster has a reaper (ray_reaper.py), started right after `ray.init`: a process of its
  own that, when this process dies without `disconnect()` (SIGKILL, the OOM killer, a second
  Ctrl-C's immediate exit), stops the processes of that cluster (and no other), then exits;
  `disconnect()` dismisses it after `ray.shutdown()` returns. A cluster that `ray.shutdown()` did not
  stop (it raised or timed out) keeps its reaper armed until this process exits. A joined cluster
  gets no reaper.
- Ray's head processes die with the *thread* that started them (they are spawned with
  PR_SET_PDEATHSIG), so `ray.init` runs on a thread of its own that lives until `disconnect()`
  (not the event loop's: the start takes seconds; not a short-lived worker thread: the cluster would
  die with it). If the process ends without `disconnect()` (even by SIGKILL), the head processes end
  with it; the reaper stops what the raylet started (agents, workers), which would not.
- SIGINT and SIGTERM stay asyncgrpo's (signals.py): Ray's failure signal handler is turned off
  (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1`, unless the environment sets it, before Ray is first
  imported: Ray reads it then), which would otherwise dump a stack and abort the process after a
  clean stop.
- `ray` is imported only here and in the actor modules, so the local runtime does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from typing import Any

from asyncgrpo.config import RayConfig
from asyncgrpo.errors import ConfigError, GenerationError
from asyncgrpo.generation.ray_reaper import Reaper, marked_environment
from asyncgrpo.threads import run_in_daemon_thread

INSTALL_HINT = "pip install 'asyncgrpo[ray]'"


def import_ray() -> Any:
    """The `ray` module, or a ConfigError that says how to install it."""
    # Ray's failure signal handler (absl) would take SIGTERM from asyncgrpo's own handling (signals.py): it prints a
    # stack dump and aborts the process after the clean stop. Ray reads this once, when it is first imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"runtime: ray needs the ray package, which cannot be imported here ({exc}). Fix: {INSTALL_HINT}, "
            f"or set runtime: local."
        ) from None
    return ray


class RayCluster:
    def __init__(self, cfg: RayConfig, *, timeout_s: float) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._released: threading.Event | None = None  # set: the owning thread may end (after ray.shutdown)
        self._reaper: Reaper | None = None  # a local cluster's, until dismissed

    @property
    def owned(self) -> bool:
        """True when `connect()` connected this process (and `disconnect()` will let go)."""
        return self._released is not None

    async def connect(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            return
        if self.cfg.address is None:  # "local": never attach to some other cluster found on this machine
            kwargs: dict[str, Any] = {"address": "local", "num_cpus": self.cfg.num_cpus, "include_dashboard": False}
            where = f"a local Ray cluster ({self.cfg.num_cpus or 'every'} CPUs)"
        else:
            kwargs = {"address": self.cfg.address}
            where = f"the Ray cluster at ray.address = {self.cfg.address!r}"
        local = self.cfg.address is None
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[Reaper | None] = loop.create_future()
        released = threading.Event()

        def own() -> None:
            token = f"{os.getpid()}-{secrets.token_hex(8)}"  # marks this cluster's processes for its reaper
            try:
                with marked_environment(token) if local else contextlib.nullcontext():
                    context = ray.init(**kwargs)
                reaper = Reaper.start(token, context.address_info["session_dir"]) if local else None
            except BaseException as exc:  # noqa: BLE001 - handed to connect(), which names the cluster
                if ray.is_initialized():  # the reaper could not start: stop the cluster it would have watched
                    ray.shutdown()
                loop.call_soon_threadsafe(_settle, connected, None, exc)
                return
            loop.call_soon_threadsafe(_settle, connected, reaper, None)
            released.wait()  # the cluster lives as long as this thread does

        threading.Thread(target=own, name="asyncgrpo-ray", daemon=True).start()
        try:
            reaper = await connected
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
            raise GenerationError(
                f"could not start or join {where}: {type(exc).__name__}: {exc}. Fix: check ray.address (null starts a "
                f"local cluster), that the cluster runs the same Ray version as this process, and `ray status` there.",
                backend="ray") from exc
        self._released, self._reaper = released, reaper

    async def disconnect(self) -> None:
        released, self._released = self._released, None
        reaper, self._reaper = self._reaper, None
        if released is None:
            return
        ray = import_ray()

        def stop() -> None:
            ray.shutdown()
            if reaper is not None:  # only once the cluster is stopped: else it stays armed until this process exits
                reaper.dismiss()

        try:
            async with asyncio.timeout(self.timeout_s):
                await run_in_daemon_thread(stop, name="asyncgrpo-ray-shutdown")
        except TimeoutError:
            armed = "; the run's reaper stops them when this process exits" if reaper is not None else ""
            raise GenerationError(
                f"ray.shutdown() did not return within run.shutdown_timeout_s = {self.timeout_s:g} s; Ray processes of "
                f"this run may be left running{armed}. Else stop them with `ray stop` (docs/ray.md: cleaning up).",
                backend="ray") from None
        finally:
            released.set()


def _settle(future: asyncio.Future[Reaper | None], reaper: Reaper | None, error: BaseException | None) -> None:
    if future.done():  # connect() was cancelled (a reaper stays armed until this process exits)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(reaper)
