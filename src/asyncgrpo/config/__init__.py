"""Run configuration: pydantic models of the recipe's sections, YAML recipes and dotted command-line overrides.

One module per section (run.py, model.py, data.py, reward.py, env.py, generation.py, rollout.py, train.py with
train.loss in loss_config.py, eval.py, checkpoint.py, logs.py, ray.py, distill.py, and simulate.py for the
simulator's keys), the whole recipe and its cross-section rules in root.py, reading and validating recipes in
loading.py, and keys that moved in moved.py. Import the names from here: `from asyncgrpo.config import Config`.

Layering: field defaults, then the recipe file, then `key=value` overrides (values parsed as YAML, so `5`,
`true` and `[1, 2]` mean what they look like). Every model forbids unknown keys, every number has bounds and
every duration has its unit in its name.

Invariants:
- Imports no torch: a config mistake is reported in well under a second.
- `load_config` either returns a `Config` consistent in every rule of its sections or raises `ConfigError` whose
  message lists every problem, each naming the dotted key, the value, the limit and the fix. The rules an
  algorithm sets on the recipe are its own, checked the same way when the registry builds it
  (algorithms/registry.py, which every run goes through; algorithms/names.py says why not here).
- A production recipe needs no simulator key: those live in the simulate: section alone.
"""

from __future__ import annotations

from asyncgrpo.config.checkpoint import CheckpointConfig
from asyncgrpo.config.data import DataConfig
from asyncgrpo.config.distill import DistillConfig
from asyncgrpo.config.env import EnvConfig, episode_limit_s
from asyncgrpo.config.eval import EvalConfig
from asyncgrpo.config.generation import GenerationConfig, HttpConfig, LaunchConfig, LocalEngineConfig
from asyncgrpo.config.loading import (
    describe_error,
    load_config,
    merge,
    parse_overrides,
    problems_error,
    read_recipe,
    section_model,
    validate_config,
)
from asyncgrpo.config.logs import LoggingConfig, Sink
from asyncgrpo.config.model import ModelConfig
from asyncgrpo.config.moved import MOVED, at_new_places
from asyncgrpo.config.ray import RayConfig, RayRole
from asyncgrpo.config.reward import RewardConfig
from asyncgrpo.config.rollout import RolloutConfig
from asyncgrpo.config.root import Config, consistency_problems, resume_unsupported, tolerance_warnings
from asyncgrpo.config.run import RunConfig
from asyncgrpo.config.section import Device, Section
from asyncgrpo.config.simulate import (
    Distribution,
    FaultConfig,
    FaultKind,
    ScriptedEnvConfig,
    SimulateConfig,
    TokenModelConfig,
    WeightSyncFaultConfig,
)
from asyncgrpo.config.train import LoraConfig, TrainConfig
from asyncgrpo.loss_config import LossConfig

__all__ = [
    "MOVED",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "Device",
    "DistillConfig",
    "Distribution",
    "EnvConfig",
    "EvalConfig",
    "FaultConfig",
    "FaultKind",
    "GenerationConfig",
    "HttpConfig",
    "LaunchConfig",
    "LocalEngineConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "RayConfig",
    "RayRole",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "ScriptedEnvConfig",
    "Section",
    "SimulateConfig",
    "Sink",
    "TokenModelConfig",
    "TrainConfig",
    "WeightSyncFaultConfig",
    "at_new_places",
    "consistency_problems",
    "describe_error",
    "episode_limit_s",
    "load_config",
    "merge",
    "parse_overrides",
    "problems_error",
    "read_recipe",
    "resume_unsupported",
    "section_model",
    "tolerance_warnings",
    "validate_config",
]
