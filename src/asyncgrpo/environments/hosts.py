"""Choosing where an episode's environment runs: `open_host(env_cfg)` returns a fresh `EnvironmentHost`.

`env.isolation: thread` -> `ThreadHost` (sync calls on a thread of the episode's own);
`env.isolation: process` -> `ProcessHost` (a worker process, killed after the grace). Both are
built as `Host(factory_spec, observation_role)` and implement `EnvironmentHost` (protocol.py).
An `env.factory` that is a running OpenEnv server's URL (``openenv+ws://host:port``) is served by
`OpenEnvServerHost` (one session per episode) whatever `env.isolation` says: the work runs on
the server, which asyncgrpo can neither run in a thread nor kill.
`check_env` is the preflight: the factory imports and the isolation is available, or ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncgrpo.config import EnvConfig
from asyncgrpo.environments.factories import load_factory
from asyncgrpo.environments.openenv import OpenEnvServerHost, is_server_url, require_openenv
from asyncgrpo.environments.process_host import ProcessHost
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.environments.thread_host import ThreadHost


def host_class(env: EnvConfig) -> Callable[[str, str], EnvironmentHost]:
    """The host of `env.factory` and `env.isolation`, called as `Host(factory_spec, observation_role)`."""
    if is_server_url(env.factory):
        return OpenEnvServerHost
    return ProcessHost if env.isolation == "process" else ThreadHost


def open_host(env: EnvConfig) -> EnvironmentHost:
    """A host for one new episode of `env.factory` (the environment itself is made by the host's `reset`)."""
    return host_class(env)(env.factory, env.observation_role)


def check_env(env: EnvConfig | None) -> None:
    """Raise ConfigError if `env.factory` cannot be loaded (no environment is made; a server URL needs OpenEnv)."""
    if env is None:
        return
    if is_server_url(env.factory):
        require_openenv(env.factory)
    else:
        load_factory(env.factory)
