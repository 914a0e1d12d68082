"""A training run's real backends, built from its trainer: the generator and, with `train.world_size > 1`, the ranks.

- The generator serves its own copy of the trainer's weights (the in-process engine on `generation.local.device`,
  or `runtime: ray` actors), or drives HTTP servers that load them from `generation.http.weights_dir` (listed, or
  started by the run as Ray actors: `generation.http.launch`); its
  version is the trainer's (a resumed run's checkpoint step).
- The ranks are built, not started: `train` starts them first and closes them last (they own a local Ray cluster).
  With them, this process holds no trainer (no float32 weights, KL reference or optimizer state): the generators'
  first copy is read as the ranks read their weights (model.path, then the checkpoint's merged weights on resume),
  straight into the serving dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.generation.base import Generator
from asyncgrpo.training.ray_trainer import RayTrainer
from asyncgrpo.training.resume import ResumePlan


def real_generator(cfg: Config, trainer: Any, tokenizer: Any, run_dir: Path) -> Generator:
    """The generation backend: the in-process engine on its own copy of the weights, Ray actors of it, or HTTP servers."""
    if cfg.runtime == "ray" and cfg.generation.backend == "local":
        from asyncgrpo.generation.ray_pool import RayGenerator

        return RayGenerator(cfg, serving_model(cfg, trainer, "cpu"), tokenizer, version=trainer.version)
    if cfg.generation.backend == "http":
        from asyncgrpo.generation.http import HttpGenerator
        from asyncgrpo.models.loading import model_directory

        model_dir = None if cfg.model.path.startswith("builtin:") else model_directory(cfg.model.path, weights=False)  # a hub id's snapshot
        http = cfg.generation.http
        weights_dir = Path(http.weights_dir) if http.weights_dir else run_dir / "weights"
        model_config = model_dir if model_dir is not None else trainer.model.config.to_dict()
        if http.launch is not None:  # runtime: ray starts the servers (config/root.py allows launch only there)
            from asyncgrpo.generation.launch import LaunchedHttpGenerator

            return LaunchedHttpGenerator(cfg, log_dir=run_dir / "servers", weights_dir=weights_dir, model_config=model_config,
                                         initial_version=trainer.version)
        return HttpGenerator(cfg.generation, weights_dir=weights_dir, model_config=model_config, initial_version=trainer.version)
    from asyncgrpo.generation.local import LocalEngine

    local = cfg.generation.local
    served = serving_model(cfg, trainer, local.device)
    return LocalEngine(served, tokenizer, max_batch_size=local.max_batch_size, version=trainer.version)


def trainer_ranks(cfg: Config, plan: ResumePlan, tokenizer: Any) -> RayTrainer:
    """The data-parallel trainer on Ray (train.world_size > 1; not started) at the version of the checkpoint it resumes."""
    return RayTrainer(cfg, tokenizer, checkpoint=plan.checkpoint, version=int(plan.state.get("version", 0)))


def serving_model(cfg: Config, trainer: Any, device: str) -> Any:
    """The generators' own copy of the trainer's (merged) weights, in the serving dtype `model.dtype`, on `device`
    (`auto`: the trainer's). Built without a float32 intermediate, except for the ranks (see the module docstring):
    a model read at float32, as they read it, and dropped once copied."""
    import torch

    from asyncgrpo.generation.serving_copy import serving_copy
    from asyncgrpo.models.device import resolve_device

    dtype = getattr(torch, cfg.model.dtype)
    target = trainer.device if device == "auto" else resolve_device(device, key="generation.local.device")
    if isinstance(trainer, RayTrainer):
        from asyncgrpo.models.loading import load_model_and_tokenizer
        from asyncgrpo.training.checkpoint import load_weights

        model, _ = load_model_and_tokenizer(cfg.model.path, "float32", cfg.run.seed)
        if trainer.checkpoint is not None:
            load_weights(trainer.checkpoint, model)
        return serving_copy(model, model.state_dict(), dtype=dtype, device=target)
    return serving_copy(trainer.base_model, trainer.generation_weights(), dtype=dtype, device=target)
