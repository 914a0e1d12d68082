"""The sampling distribution: the logits an engine samples from, and the trainer scores with.

Job: turn a model's raw next-token logits into the distribution a completion is actually drawn from,
q = softmax(processed logits), with tokens outside the kept support at -inf. The local engine samples
from it and reports log q of each sampled token; the trainer computes log q_theta of the same tokens by
applying the same processing to its own logits (DESIGN.md §3 "Which distribution is optimised").
`token_logprobs` is the plain tempered case (no processing), which the trainer's KL reference and the
distillation teacher score with; `LOG_RATIO_CLAMP` bounds the log-ratio of two such log-probs.

Processing, in vLLM's order (each step has TRL's / vLLM's / transformers' meaning):
1. `repetition_penalty` (1.0: off): a token already in the context (prompt or completion so far) has its
   logit divided by the penalty when positive, multiplied by it otherwise.
2. `temperature`: logits / T (T = 0 is greedy: argmax, no truncation, logprobs at T = 1).
3. `min_p` (0.0: off): drop tokens whose probability is below min_p x the top token's.
4. `top_k` (0: off): keep the k most probable tokens (ties at the k-th value are kept).
5. `top_p` (1.0: off): keep the smallest most-probable set whose mass reaches top_p, computed on the
   distribution left by steps 3-4 (transformers' and vLLM's rule: drop a token when the mass of the
   tokens no more probable than it is <= 1 - top_p); the most probable token is always kept.
transformers' `generate` runs top-k, top-p, min-p in that order instead; the two orders differ only when
min_p and top_p < 1 are combined (tests/unit/test_sampling.py checks both knobs alone and each pair
against transformers' processors in vLLM's order).

Invariants:
- The kept set is computed without gradient (it is piecewise constant in the logits); the returned
  logits carry the gradient of the penalty and temperature, so log q's gradient renormalises over the
  kept set.
- At least one token (the most probable) is always kept; with every knob off the result is
  logits / T exactly.
- Rows are independent: every knob may be a per-row tensor `[N]` or a scalar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# The bound on a log-ratio of two distributions' log-probs: the loss clamps its log-ratios to +-this before `exp`,
# distillation its per-token advantages, so one wild token gives a large finite value, never inf or NaN.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Processing:
    """The sampling knobs of one distribution (scalars; `per_row` stacks them for a batch)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def truncates(self) -> bool:
        """Whether the support is smaller than the vocabulary (sampling only: T > 0)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0


def _column(value: float | Tensor, rows: int, like: Tensor) -> Tensor:
    """A knob as a `[rows, 1]` tensor on `like`'s device."""
    t = torch.as_tensor(value, device=like.device, dtype=torch.float32)
    return t.expand(rows).reshape(rows, 1) if t.dim() == 0 else t.reshape(rows, 1)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float | Tensor) -> Tensor:
    """logits `[..., V]` with every `seen` token (bool `[..., V]`) penalised: x / penalty if x > 0 else x * penalty."""
    p = torch.as_tensor(penalty, device=logits.device, dtype=logits.dtype)
    if p.dim() > 0:
        p = p.reshape(p.shape + (1,) * (logits.dim() - p.dim()))
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


@torch.no_grad()
def kept_support(scaled: Tensor, *, top_k: float | Tensor = 0, top_p: float | Tensor = 1.0,
                 min_p: float | Tensor = 0.0) -> Tensor:
    """Bool `[N, V]`: the tokens min-p, then top-k, then top-p keep, of temperature-scaled logits `[N, V]`."""
    rows = scaled.shape[0]
    x = scaled.detach().float()
    keep = torch.ones_like(x, dtype=torch.bool)
    mp = _column(min_p, rows, x)
    if bool((mp > 0).any()):
        probs = torch.softmax(x, dim=-1)
        keep &= probs >= mp * probs.amax(dim=-1, keepdim=True)
    k = _column(top_k, rows, x).long()
    if bool((k > 0).any()):
        masked = x.masked_fill(~keep, float("-inf"))
        width = int(min(int(k.max()), x.shape[-1]))
        kth = masked.topk(width, dim=-1).values.gather(1, (k.clamp(1, width) - 1))
        keep &= (k <= 0) | (masked >= kth)
    tp = _column(top_p, rows, x)
    if bool((tp < 1).any()):
        masked = x.masked_fill(~keep, float("-inf"))
        ascending, order = torch.softmax(masked, dim=-1).sort(dim=-1, descending=False)
        drop = ascending.cumsum(dim=-1) <= (1 - tp)
        drop[:, -1] = False  # the most probable token always stays
        drop &= tp < 1
        keep &= ~drop.scatter(1, order, drop)
    return keep


def processed_logits(logits: Tensor, p: Processing, *, seen: Tensor | None = None) -> Tensor:  # the engine's side
    """The logits of the sampling distribution of `p`, float32, -inf outside the kept support.

    logits `[N, V]`; `seen` bool `[N, V]` (the context's tokens; needed when `p.penalises`). Greedy
    (`temperature == 0`) is scored at T = 1 without truncation, as vLLM reports it."""
    x = logits.float()
    if p.penalises:
        if seen is None:
            raise ValueError("repetition_penalty != 1 needs the context's tokens (seen)")
        x = apply_repetition_penalty(x, seen, p.repetition_penalty)
    if p.temperature > 0 and p.temperature != 1.0:
        x = x / p.temperature
    if not p.truncates:
        return x
    keep = kept_support(x, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    return x.masked_fill(~keep, float("-inf"))


def seen_before(input_ids: Tensor, attention_mask: Tensor, vocab_size: int, positions: Tensor) -> Tensor:
    """Bool `[B, T, V]`: token v occurs in row b's attended inputs at or before input position `positions[t]`.

    input_ids / attention_mask `[B, L]`; positions `[T]` (input positions whose logits are scored). This is
    the repetition penalty's context for the token predicted at each position (prompt + completion so far)."""
    length = input_ids.shape[1]
    index = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    index = torch.where(attention_mask.bool(), index, torch.full_like(index, length))
    first = torch.full((input_ids.shape[0], vocab_size), length, dtype=torch.long, device=input_ids.device)
    first.scatter_reduce_(1, input_ids.long(), index, reduce="amin")
    return first[:, None, :] <= positions.to(first.device)[None, :, None]


def token_logprobs(
    logits: Tensor, target_ids: Tensor, temperature: float = 1.0, *, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of `target_ids` under softmax(logits / temperature), and the entropy.

    logits `[B, T, V]` (any float dtype; computed in float32), target_ids `[B, T]` (int64).
    Returns (logp `[B, T]` float32 with grad, entropy `[B, T]` float32 detached, or None when
    `with_entropy` is False). The entropy is that of the same tempered distribution, in nats.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            detached = logp_all.detach()
            entropy = -(detached.exp() * detached).sum(-1)
    return logp, entropy


ROWS_PER_CHUNK = 1024  # kept_support sorts a float32 copy of the logits: bound it to this many positions at once


def sampled_logprobs(logits: Tensor, target_ids: Tensor, p: Processing, *, seen: Tensor | None = None,
                     with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """The trainer's side: log q of `target_ids` under the sampling distribution `p` of `logits`, and its entropy.

    logits `[B, T, V]`, target_ids `[B, T]`, `seen` bool `[B, T, V]` (`seen_before`; needed when `p.penalises`).
    The support is recomputed from these logits (never carried from the engine): at staleness 0 it is the
    engine's own, token for token up to float rounding; later it is the support the current policy would
    sample from, so a token that left it has log q = -inf (ratio 0: it no longer belongs to the objective).
    Returns (logp `[B, T]` float32 with grad, entropy `[B, T]` detached or None), like `token_logprobs`."""
    b, t, v = logits.shape
    x = logits.float()
    if p.penalises:
        if seen is None:
            raise ValueError("repetition_penalty != 1 needs the context's tokens (seen)")
        x = apply_repetition_penalty(x, seen, p.repetition_penalty)
    if p.temperature != 1.0:
        x = x / p.temperature
    if p.truncates:
        flat = x.reshape(b * t, v)
        keep = torch.cat([kept_support(flat[i : i + ROWS_PER_CHUNK], top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
                          for i in range(0, b * t, ROWS_PER_CHUNK)]) if b * t else flat.bool()
        x = x.masked_fill(~keep.reshape(b, t, v), float("-inf"))
    logq_all = torch.log_softmax(x, dim=-1)
    logq = logq_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            detached = logq_all.detach()
            entropy = -(detached.exp() * detached.nan_to_num(neginf=0.0)).sum(-1)
    return logq, entropy
