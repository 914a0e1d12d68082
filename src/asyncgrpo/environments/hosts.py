"""Choosing where an episode's environment runs: `open_host(env_cfg)` returns a fresh `EnvironmentHost`.

`env.isolation: thread` -> `ThreadHost` (sync calls on a thread of the episode's own);
`env.isolation: process` -> `ProcessHost` (a worker process, killed after the grace). Both are
built as `Host(factory_spec, observation_role)` and implement `EnvironmentHost` (protocol.py).
"""

from __future__ import annotations

from asyncgrpo.config import EnvConfig
from asyncgrpo.environments.protocol import EnvironmentHost
from asyncgrpo.environments.thread_host import ThreadHost
from asyncgrpo.errors import ConfigError


def open_host(env: EnvConfig) -> EnvironmentHost:
    """A host for one new episode of `env.factory` (the environment itself is made by the host's `reset`)."""
    if env.isolation == "process":
        raise ConfigError(
            "env.isolation = 'process' is not available in this build: worker-process hosts are not part of it yet. "
            "Fix: set env.isolation: thread (an environment that ignores its cancel token is then counted in "
            "env/abandoned_total instead of killed)."
        )
    return ThreadHost(env.factory, env.observation_role)
