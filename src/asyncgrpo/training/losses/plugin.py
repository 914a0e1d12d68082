"""`train.loss.type: module:function`: your own per-token objective (docs/losses.md has a worked example).

The function is called once per micro-batch with one `LossBatch` and returns the per-token loss, a float tensor
of shape `[B, T]` with gradient through `batch.logp`. asyncgrpo then applies what every type gets: the off-policy
weight (`objective: decoupled`), the KL penalty (`kl_coef`), the mask, and the normalisation
(`train.loss.normalization`: token, also when unset, or sequence), so micro-batching never changes the gradient.

Invariants: the function is imported with the loader of every config key that names user code (user_modules.py), so
a module or name that does not load is a `ConfigError` naming `train.loss.type` before any model loads (commands/train.py's preflight);
a result that is not a `[B, T]` floating tensor, or that has no gradient, is a `ConfigError` naming the function,
what it returned and what it must return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncgrpo.errors import ConfigError
from asyncgrpo.user_modules import import_user_module, lookup_attribute

KEY = "train.loss.type"
LossFunction = Callable[["LossBatch"], Tensor]


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch, every tensor `[B, T]` aligned: row b is one completion, column t its token t.

    logp: log pi_theta of each sampled token at generation.temperature, with grad (the only tensor that has one).
    logp_gen: the behaviour log-probs: what the generator reported when it sampled the token (its weights may be stale).
    logp_prox: the trainer's log-probs at the weights the step started from (objective: decoupled), else None.
    advantages: each token's advantage (a GRPO sequence's advantage repeated over its tokens).
    mask: True on the loss tokens (completion tokens that count; never prompt, padding or environment tokens).
    staleness: per token, the trainer's policy version minus the version whose weights generated it (0: on-policy).
    clip_low, clip_high: train.loss.clip_low / clip_high, for objectives that clip.
    """

    logp: Tensor
    logp_gen: Tensor
    logp_prox: Tensor | None
    advantages: Tensor
    mask: Tensor
    staleness: Tensor
    clip_low: float
    clip_high: float


def resolve_loss_plugin(spec: str) -> LossFunction:
    """The function `spec` = ``module:function`` names (the module dotted or a path to a .py file)."""
    module_name, _, attr_path = spec.rpartition(":")
    obj = lookup_attribute(
        import_user_module(module_name, KEY, spec), module_name, attr_path, KEY, spec,
        fix=lambda _obj, missing: f"define {missing}(batch: asyncgrpo.training.losses.plugin.LossBatch) -> Tensor there (docs/losses.md).",
    )
    if not callable(obj):
        raise ConfigError(
            f"{KEY} = {spec!r}: {attr_path} is a {type(obj).__name__}, not a function. Fix: point it at a function "
            f"loss(batch: LossBatch) -> Tensor returning the per-token loss [B, T] (docs/losses.md)."
        )
    fn: LossFunction = obj
    return fn


def call_plugin(fn: LossFunction, spec: str, batch: LossBatch) -> Tensor:
    """`fn(batch)`, checked: a floating `[B, T]` tensor with a gradient."""
    out = fn(batch)
    want = tuple(batch.logp.shape)
    if not isinstance(out, Tensor) or tuple(out.shape) != want or not torch.is_floating_point(out):
        got = f"a tensor of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, Tensor) else f"a {type(out).__name__}"
        raise ConfigError(
            f"{KEY} = {spec!r} returned {got}, but a loss function must return the per-token loss: a floating tensor of "
            f"shape [B, T] = {want}, like batch.logp (asyncgrpo masks and normalises it). Fix: return the per-token "
            f"values, e.g. -(ratio * batch.advantages), without summing or averaging them."
        )
    if not out.requires_grad:
        raise ConfigError(
            f"{KEY} = {spec!r} returned a tensor with no gradient: nothing would be trained. Fix: compute the loss from "
            f"batch.logp (the only input with a gradient) and do not detach it."
        )
    return out
