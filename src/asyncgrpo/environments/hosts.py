"""Choosing where an episode's environment runs: `open_host(env_cfg)` returns a fresh `EnvironmentHost`.

`env.isolation: thread` -> `ThreadHost` (sync calls on a thread of the episode's own);
`env.isolation: process` -> `ProcessHost` (a worker process, killed after the grace). Both are
built as `Host(factory_spec, observation_role)` and implement `EnvironmentHost` (protocol.py).
`check_env` is the preflight: the factory imports and the isolation is available, or ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncgrpo.config import EnvConfig
from asyncgrpo.environments.factories import load_factory
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.environments.thread_host import ThreadHost
from asyncgrpo.errors import ConfigError


def host_class(env: EnvConfig) -> Callable[[str, str], EnvironmentHost]:
    """The host of `env.isolation`, called as `Host(factory_spec, observation_role)`."""
    if env.isolation == "process":
        raise ConfigError(
            "env.isolation = 'process' is not available in this build: worker-process hosts are not part of it yet. "
            "Fix: set env.isolation: thread (an environment that ignores its cancel token is then counted in "
            "env/abandoned_total instead of killed)."
        )
    return ThreadHost


def open_host(env: EnvConfig) -> EnvironmentHost:
    """A host for one new episode of `env.factory` (the environment itself is made by the host's `reset`)."""
    return host_class(env)(env.factory, env.observation_role)


def check_env(env: EnvConfig | None) -> None:
    """Raise ConfigError if `env.factory` cannot be loaded or `env.isolation` cannot be served (no environment is made)."""
    if env is not None:
        load_factory(env.factory)
        host_class(env)
