"""Gradient checkpointing (`train.gradient_checkpointing`) for the trainer's transformers model.

Invariant: only the decoder layers' own `training` flag is set (transformers checkpoints a layer only while it is
set); their submodules stay in eval mode, so the model's dropouts stay off (training/trainer.py's invariants).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.errors import ConfigError


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward pass, every dropout still off; a ConfigError when
    the model cannot."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"train.gradient_checkpointing = true, but {type(model).__name__} (model.path) does not support it. Fix: set "
            f"train.gradient_checkpointing: false, or lower train.micro_batch_size to save memory instead."
        )
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers checkpoints a layer only while layer.training is set; setting that flag alone
    # (not .train(), which recurses) keeps every dropout inside the layers off.
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.training = True
