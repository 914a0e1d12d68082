"""`RayCluster`: this process's connection to Ray for one run: join a cluster or start a local one, then let go.

Job: `connect()` joins `ray.address`, or (address null) starts a fresh local cluster of
`ray.num_cpus` CPUs without the dashboard; `disconnect()` undoes exactly what `connect()` did.

Invariants:
- `connect()` is bounded by `ray.startup_timeout_s`: a joined address is first probed with one TCP
  connection (ray_address.py: nothing listening is an error at once), then `ray.init` runs on its
  own thread (below) and is abandoned at the deadline, with an error naming ray.address, its value,
  what was tried and the fix (`ray.init` where nothing answers never returns). An abandoned start
  that completes later is shut down by its thread; a stuck one is a daemon thread, which does not
  keep the process from exiting.
- A local cluster is this machine's and this user's only: every Ray process of it listens on
  127.0.0.1 (`_node_ip_address`, with Ray's single-node mode `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
  set before Ray is first imported: without it Ray rewrites a loopback address to the machine's
  interface address, and its servers listen on every interface); its session files live in a
  private directory (mode 0700, under RAY_TMPDIR or the system's temp dir; Ray makes its own
  directories in there world-writable), removed after a clean `ray.shutdown()`; and its
  authentication token is a fresh secret handed to its processes in their environment (readable
  by this user only), never a file (Ray's default, ~/.ray/auth_token, is written world-readable).
  A token or auth mode the user set (RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) is kept.
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
- SIGINT and SIGTERM stay asyncgrpo's (commands/signals.py): Ray's failure signal handler is turned off
  (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1`, unless the environment sets it, before Ray is first
  imported: Ray reads it then), which would otherwise dump a stack and abort the process after a
  clean stop. `ray_environment_defaults()` sets both variables Ray reads at import; whoever imports
  Ray before asyncgrpo does (a test helper) calls it first.
- `ray` is imported only here and in the actor modules, so the local runtime does not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from typing import Any

from asyncgrpo.config import RayConfig
from asyncgrpo.errors import ConfigError, GenerationError
from asyncgrpo.generation.ray_address import probe
from asyncgrpo.generation.ray_reaper import Reaper, marked_environment
from asyncgrpo.threads import run_in_daemon_thread

log = logging.getLogger("asyncgrpo.ray")

INSTALL_HINT = "pip install 'asyncgrpo[ray]'"
LOOPBACK = "127.0.0.1"
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def ray_environment_defaults() -> None:
    """Set (unless the environment does) what Ray reads once, when it is first imported."""
    # Ray's failure signal handler (absl) would take SIGTERM from asyncgrpo's own handling (commands/signals.py): it prints a
    # stack dump and aborts the process after the clean stop.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    # Ray's single-node mode: a loopback address stays loopback (ray.address = 127.0.0.1:PORT, a local cluster's
    # _node_ip_address) instead of becoming the machine's interface address. Nodes joined from elsewhere are unaffected:
    # a driver joining a cluster takes its node's address from the cluster.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def import_ray() -> Any:
    """The `ray` module, or a ConfigError that says how to install it."""
    ray_environment_defaults()
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
        self._private_dir: str | None = None  # a local cluster's session files, removed after a clean stop

    @property
    def owned(self) -> bool:
        """True when `connect()` connected this process (and `disconnect()` will let go)."""
        return self._released is not None

    async def connect(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            return
        local = self.cfg.address is None
        private_dir = None
        if local:  # "local": never attach to some other cluster found on this machine
            private_dir = tempfile.mkdtemp(prefix="agr-", dir=os.environ.get("RAY_TMPDIR") or None)  # mode 0700
            kwargs: dict[str, Any] = {"address": "local", "num_cpus": self.cfg.num_cpus, "include_dashboard": False,
                                      "_node_ip_address": LOOPBACK, "_temp_dir": os.path.join(private_dir, "ray")}
            where = f"a local Ray cluster ({self.cfg.num_cpus or 'every'} CPUs)"
        else:
            kwargs = {"address": self.cfg.address}
            where = f"the Ray cluster at ray.address = {self.cfg.address!r}"
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[Reaper | None] = loop.create_future()
        released, abandoned = threading.Event(), threading.Event()

        def own() -> None:
            token = f"{os.getpid()}-{secrets.token_hex(8)}"  # marks this cluster's processes for its reaper
            reaper = None
            try:
                with marked_environment(token, _auth_environment()) if local else contextlib.nullcontext():
                    _reload_auth_settings(ray)
                    context = ray.init(**kwargs)
                if local:
                    _check_loopback(context.address_info["node_ip_address"])
                    reaper = Reaper.start(token, context.address_info["session_dir"])
            except BaseException as exc:  # noqa: BLE001 - handed to connect(), which names the cluster
                _stop(ray, None, private_dir)  # e.g. the reaper could not start: stop the cluster it would have watched
                _call_soon(loop, _settle, connected, None, exc)
                return
            _call_soon(loop, _settle, connected, reaper, None)
            released.wait()  # the cluster lives as long as this thread does
            if abandoned.is_set():  # connect() gave up as the start completed: nobody else will stop this cluster
                _stop(ray, reaper, private_dir)

        tried: list[str] = []
        try:
            async with asyncio.timeout(self.cfg.startup_timeout_s) as deadline:
                if self.cfg.address is not None:
                    tried.append(await probe(self.cfg.address))
                threading.Thread(target=own, name="asyncgrpo-ray", daemon=True).start()
                tried.append(f"ray.init({', '.join(f'{k}={v!r}' for k, v in kwargs.items() if v is not None)})")
                reaper = await connected
        except BaseException as exc:
            abandoned.set()  # a start still under way is stopped (and its directory removed) by its thread
            released.set()
            if deadline.expired():
                raise GenerationError(self._timeout_message(where, tried), backend="ray") from None
            if isinstance(exc, GenerationError) or not isinstance(exc, Exception):
                raise
            raise GenerationError(
                f"could not start or join {where}: {type(exc).__name__}: {exc}. Fix: check ray.address (null starts a "
                f"local cluster), that the cluster runs the same Ray version as this process, and `ray status` there.",
                backend="ray") from exc
        self._released, self._reaper, self._private_dir = released, reaper, private_dir

    def _timeout_message(self, where: str, tried: list[str]) -> str:
        steps = "; then ".join(tried) if tried else f"a TCP connection to {self.cfg.address!r}"
        fix = ("check that this machine can start Ray (`ray start --head` by hand says why it cannot), or raise "
               "ray.startup_timeout_s on a slow machine" if self.cfg.address is None else
               "check that ray.address is the cluster's address (host:port, as `ray status` on its head node prints "
               "it) and reachable from here (a firewall that drops packets looks like this), that the cluster runs the "
               "same Ray version as this process and has this machine's token (RAY_AUTH_TOKEN or ~/.ray/auth_token), "
               "or set ray.address: null to start a local cluster for this run")
        return (f"could not start or join {where} within ray.startup_timeout_s = {self.cfg.startup_timeout_s:g} s "
                f"(tried: {steps}; the last did not finish, and was abandoned). Fix: {fix}.")

    async def disconnect(self) -> None:
        released, self._released = self._released, None
        reaper, self._reaper = self._reaper, None
        private_dir, self._private_dir = self._private_dir, None
        if released is None:
            return
        ray = import_ray()

        try:
            async with asyncio.timeout(self.timeout_s):
                await run_in_daemon_thread(lambda: _stop(ray, reaper, private_dir), name="asyncgrpo-ray-shutdown")
        except TimeoutError:
            armed = "; the run's reaper stops them when this process exits" if reaper is not None else ""
            raise GenerationError(
                f"ray.shutdown() did not return within run.shutdown_timeout_s = {self.timeout_s:g} s; Ray processes of "
                f"this run may be left running{armed}. Else stop them with `ray stop` (docs/ray.md: cleaning up).",
                backend="ray") from None
        finally:
            released.set()


def _stop(ray: Any, reaper: Reaper | None, private_dir: str | None) -> None:
    """`ray.shutdown()` (a no-op when not connected), then dismiss the reaper (only once the cluster is stopped: else it stays armed until this
    process exits) and remove a local cluster's directory; a later `ray.init` reads its auth settings afresh."""
    ray.shutdown()
    if reaper is not None:
        reaper.dismiss()
    if private_dir is not None:
        _reload_auth_settings(ray)
        _remove(private_dir)


def _auth_environment() -> dict[str, str]:
    """A fresh token for a local cluster, handed to its processes in their environment; {} if the user chose one."""
    if any(name in os.environ for name in _AUTH_VARS):
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _reload_auth_settings(ray: Any) -> None:
    """Make this process read the auth mode and token from the environment as it is now: Ray read the mode when it was
    imported and keeps the first token it loads (an earlier cluster's). What Ray itself does when it enables token auth
    (ray 2.60, pinned: `_private/authentication/authentication_token_setup.py`)."""
    ray._raylet.Config.initialize("")
    ray._raylet.AuthenticationTokenLoader.instance().reset_cache()


def _check_loopback(node_ip: str) -> None:
    if node_ip != LOOPBACK:
        log.warning("the local Ray cluster listens on %s, not only on %s: Ray was imported before asyncgrpo could set "
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (or the environment sets it otherwise). Set it to 0 in the "
                    "environment to keep the cluster on this machine.", node_ip, LOOPBACK)


def _remove(private_dir: str | None) -> None:
    if private_dir is not None:
        shutil.rmtree(private_dir, ignore_errors=True)


def _call_soon(loop: asyncio.AbstractEventLoop, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: connect() is long gone, `abandoned` says what to do
        loop.call_soon_threadsafe(*args)


def _settle(future: asyncio.Future[Reaper | None], reaper: Reaper | None, error: BaseException | None) -> None:
    if future.done():  # connect() gave up (cancelled, deadline): the owning thread stops what it started
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(reaper)
