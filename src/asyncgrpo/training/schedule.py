"""The learning-rate schedule (`train.lr_schedule`) as a factor of `train.lr`, and applying it to a loaded optimizer.

Invariants: the factor is in (0, 1] during training: linear warm-up over `train.warmup_steps` steps, then
constant, or linear / cosine decay from 1 at the end of warm-up to 0 at `train.max_steps` (so the last step
trains at a small positive rate). A loaded optimizer follows this run's values from its next update on.
"""

from __future__ import annotations

import math

import torch

from asyncgrpo.config import TrainConfig


def lr_factor(t: TrainConfig, step: int) -> float:
    """The schedule at `step` (0-based)."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    if t.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_hyperparameters(t: TrainConfig, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Make a loaded optimizer follow this run's train.lr, weight_decay, warm-up and schedule from the next update on.

    A saved optimizer and scheduler carry the values of the run that saved them; a resumed
    run with changed values reports the change, so it must also train with it."""
    scheduler.base_lrs = [t.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = t.lr
        group["weight_decay"] = t.weight_decay
        group["lr"] = t.lr * lr_factor(t, scheduler.last_epoch)
