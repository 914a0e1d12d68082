"""generation.http.launch (servers the run starts as Ray actors): where it is allowed, its bounds, what each actor runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncgrpo.config import load_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.generation.launch import launch_specs

LAUNCH = ("runtime=ray", "generation.backend=http", "generation.http.launch.count=2")


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return str(info.value)


def test_launch_needs_the_ray_runtime_and_the_http_backend_and_names_the_fix():
    message = error_of("generation.backend=http", "generation.http.launch.count=2")
    assert "generation.http.launch" in message and "runtime = 'local'" in message and "Fix: set runtime: ray" in message
    message = error_of("runtime=ray", "generation.http.launch.count=2")
    assert "generation.backend = 'local'" in message and "generation.backend: http" in message


def test_a_count_below_one_is_refused_naming_the_key():
    message = error_of(*LAUNCH[:2], "generation.http.launch.count=0")
    assert "generation.http.launch.count" in message and "greater than or equal to 1" in message


def test_the_http_backend_on_ray_without_servers_points_to_launch():
    message = error_of("runtime=ray", "generation.backend=http")
    assert "generation.http.base_urls" in message and "generation.http.launch: {count: 2}" in message


def test_launched_servers_count_in_the_local_clusters_cpus():
    message = error_of(*LAUNCH, "generation.http.launch.num_cpus=1.5", "ray.num_cpus=2")
    assert "generation.http.launch.count = 2 servers x generation.http.launch.num_cpus = 1.5" in message
    assert "need 3 CPUs" in message and "ray.num_cpus = 2" in message
    load_config(None, [*LAUNCH, "ray.num_cpus=2", "ray.generators=4"])  # ray.generators make no actors here


def test_each_actor_runs_the_engines_command_with_the_model_then_the_args(tmp_path: Path):
    cfg = load_config(None, [*LAUNCH, "generation.http.launch.args=[--max-batch-size, '8']",
                             "generation.http.launch.env={A: b}"])
    specs = launch_specs(cfg, tmp_path)
    assert [s.name for s in specs] == ["server-0", "server-1"]
    assert specs[0].command == (sys.executable, "-m", "asyncgrpo.commands.cli", "serve")
    assert specs[0].model_args == (cfg.model.path,) and specs[0].args == ("--max-batch-size", "8") and specs[0].env == (("A", "b"),)
    vllm = load_config(None, [*LAUNCH, "generation.http.launch.engine=vllm"])
    assert launch_specs(vllm, tmp_path)[0].command == ("vllm", "serve")
    assert launch_specs(vllm, tmp_path)[0].model_args == ("--model", cfg.model.path)  # also what vLLM's api_server takes
    own = load_config(None, [*LAUNCH, "generation.http.launch.command=[/opt/v/bin/vllm, serve]"])
    assert launch_specs(own, tmp_path)[1].command == ("/opt/v/bin/vllm", "serve")
