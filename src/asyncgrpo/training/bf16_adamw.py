"""`Bf16StateAdamW`: AdamW whose two moments are stored in bfloat16 (`train.optimizer_state_dtype: bfloat16`).

Job: the update of `torch.optim.AdamW` (decoupled weight decay, bias-corrected moments) on float32
master weights at half the state memory: 4 bytes per parameter for both moments instead of 8.

Invariants:
- Every update is computed in float32 on buckets of at most `CHUNK` elements (a large parameter
  in slices, small ones gathered together), so each float32 temporary is at most 16 MB however large
  the model is. Only the stored moments are bfloat16; the parameters keep their own dtype.
- Each stored moment is rounded to bfloat16 *stochastically* (`stochastic_round`): rounded up with
  probability equal to the distance to the lower neighbour, so the stored value is unbiased. Round-
  to-nearest would freeze the second moment: with beta2 = 0.999, 0.999 * v is within half a bfloat16
  step (2^-8 relative) of v and rounds back to v, so v would never decay.
- The rounding noise comes from one `torch.Generator` per device, seeded with `seed` (the run's
  seed): two optimizers with the same seed fed the same gradients make bit-identical updates (data-
  parallel ranks stay identical), and `state_dict` carries the generators' states so a resumed run
  draws the noise it would have drawn.
- `state_dict` has the layout of `torch.optim.AdamW` (per parameter `step`, `exp_avg`,
  `exp_avg_sq`) plus the generators; `load_state_dict` keeps the moments in bfloat16 (torch's
  default would cast them to the parameters' float32) and accepts a float32 AdamW state (rounded once);
  torch.optim.AdamW loads this one's state too (as float32 moments).
- A sharded parameter (a DTensor: `train.sharding: fsdp`, training/sharding.py) gets moments
  sharded like it, and each rank updates its own shard (`local`) as above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor

CHUNK = 1 << 22  # elements updated at once (a larger parameter in slices, smaller ones together)
MOMENTS = ("exp_avg", "exp_avg_sq")
_HIGH_BITS = -(1 << 16)  # int32 0xFFFF0000: the bits a bfloat16 keeps of a float32


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded tensor (a DTensor), sharing its storage; a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)  # DTensor's; no import of torch.distributed here
    return to_local() if callable(to_local) else tensor


def stochastic_round(values: Tensor, generator: torch.Generator) -> Tensor:
    """`values` (float32, contiguous) rounded to bfloat16, up or down at random so that the expected result is the value.

    A bfloat16 is the high 16 bits of a float32. Adding a uniform random integer in [0, 2^16) to the
    float32's bit pattern and dropping the low 16 bits carries into the kept bits with probability
    (low bits) / 2^16, i.e. rounds the magnitude up with probability equal to the fraction of the way
    to the next bfloat16. Infinities stay infinite (their low bits are zero and stay below a carry).
    """
    noise = _uniform_16_bits(values.numel(), generator, values.device).view(values.shape)
    noise.add_(values.view(torch.int32)).bitwise_and_(_HIGH_BITS)
    return noise.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def _uniform_16_bits(count: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """`count` independent uniform integers in [0, 2^16) (int32), four from each 64-bit draw (a third of randint's time)."""
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None, generator=generator)
    return words.view(torch.int16)[:count].to(torch.int32).bitwise_and_(0xFFFF)


@dataclass(frozen=True)
class _Piece:
    """Elements [lo, hi) of `param` (flattened; this rank's shard), its gradient and its moments in `state`."""

    param: Tensor
    grad: Tensor
    state: dict[str, Any]
    lo: int
    hi: int


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW (as torch.optim.AdamW, non-amsgrad) with bfloat16 moments rounded stochastically; see the module docstring."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Bf16StateAdamW: invalid hyperparameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[key]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pieces: dict[float, list[_Piece]] = {}  # by step count: one bias correction per bucket
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Bf16StateAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in MOMENTS:
                        state[name] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
                state["step"] += 1
                shard, grad = local(param), local(param.grad)
                size = shard.numel()
                # A non-contiguous parameter (rare) is one piece, written through its own shape.
                bounds = range(0, size, CHUNK) if shard.is_contiguous() else range(1)
                pieces.setdefault(float(state["step"]), []).extend(
                    _Piece(shard, grad, state, lo, min(lo + CHUNK, size) if shard.is_contiguous() else size) for lo in bounds
                )
            for step, found in pieces.items():
                bucket: list[_Piece] = []
                for piece in found:
                    if bucket and sum(p.hi - p.lo for p in bucket) + piece.hi - piece.lo > CHUNK:
                        self._update(bucket, group, step)
                        bucket = []
                    bucket.append(piece)
                if bucket:
                    self._update(bucket, group, step)
        return loss

    def _update(self, bucket: list[_Piece], group: dict[str, Any], step: float) -> None:
        """AdamW on the pieces of `bucket` (at most CHUNK elements in all) as one flat float32 vector.

        Small parameters share a bucket so that the arithmetic runs as a few large operations
        instead of a score per parameter (each operation is a thread-pool round trip)."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        generator = self._generator(bucket[0].param.device)
        grad = torch.cat([p.grad.reshape(-1)[p.lo : p.hi] for p in bucket]).float()
        m = torch.cat([local(p.state["exp_avg"]).view(-1)[p.lo : p.hi] for p in bucket]).float().lerp_(grad, 1 - beta1)
        v = torch.cat([local(p.state["exp_avg_sq"]).view(-1)[p.lo : p.hi] for p in bucket]).float()
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        update = m / (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        update.mul_(-lr / (1 - beta1**step))
        m, v = stochastic_round(m, generator), stochastic_round(v, generator)
        offset = 0
        for p in bucket:
            part = slice(offset, offset + p.hi - p.lo)
            offset = part.stop
            weights = p.param.view(-1)[p.lo : p.hi] if p.param.is_contiguous() else p.param
            if decay:
                weights.mul_(1 - lr * decay)
            weights.add_(update[part].view(weights.shape).to(weights.dtype))
            local(p.state["exp_avg"]).view(-1)[p.lo : p.hi] = m[part]
            local(p.state["exp_avg_sq"]).view(-1)[p.lo : p.hi] = v[part]

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["rounding_generators"] = {device: g.get_state() for device, g in self._generators.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading for steps and groups; the moments are put back in bfloat16 without a float32 copy."""
        saved_state = state_dict["state"]
        moments = {key: {name: s[name] for name in MOMENTS if name in s} for key, s in saved_state.items()}
        stripped = {key: {name: v for name, v in s.items() if name not in MOMENTS} for key, s in saved_state.items()}
        super().load_state_dict({"state": stripped, "param_groups": state_dict["param_groups"]})
        id_map = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for key, tensors in moments.items():
            param = id_map[key]
            for name, value in tensors.items():
                self.state[param][name] = value.to(device=param.device, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        self._generators = {}
        here = {str(p.device) for p in chain.from_iterable(g["params"] for g in self.param_groups)}
        for device, generator_state in state_dict.get("rounding_generators", {}).items():
            if device in here:  # a state saved on another device starts that device's stream afresh from the seed
                self._generator(torch.device(device)).set_state(generator_state)
