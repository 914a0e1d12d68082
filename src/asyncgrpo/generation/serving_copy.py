"""The generation engine's own copy of a model: a new model of the same architecture in the serving dtype on the
serving device, holding given weights (`serving_copy`). Used where the in-process engine (generation/local.py) must
not share the trainer's parameters."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch


def serving_copy(model: Any, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> Any:
    """A new model of `model`'s architecture, in `dtype` on `device`, holding `state` (names as in
    `model.state_dict()`; e.g. a trainer's `generation_weights()`) and `model`'s buffers.

    Built on the meta device and allocated once in `dtype`, so the engine's copy costs
    dtype-size bytes per parameter, never a float32 copy first."""
    with torch.device("meta"):
        replica = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    replica = replica.to_empty(device=device)
    replica.tie_weights()
    targets = replica.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in state]
    if missing:
        raise ValueError(f"serving_copy: the weights lack {missing[:5]} of the model's {len(targets)} tensors")
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state[name])
        for name, buffer in replica.named_buffers():  # non-persistent ones (rotary frequencies) are not in state
            buffer.copy_(buffers[name])
    return replica.eval().requires_grad_(False)
