"""Varlen attention for packed rows without flash-attn: scaled_dot_product_attention per sequence, no T x T mask.

Job: a transformers attention implementation, `NAME`, registered with `AttentionInterface` and
`AttentionMaskInterface`. For a packed row (no attention mask, position ids restarting at 0 for each sequence,
training/packing.py) it cuts the row at the position resets and runs causal SDPA on each sequence, batching the
sequences of equal length into one call, so a row of sequences L_1..L_n costs sum L_i^2 attention, not T^2, and
no dense block-diagonal T x T mask is built (sdpa's path in transformers builds one). Every other call (a padding
mask, a KV cache, a single sequence) is transformers' own sdpa, unchanged. `use_varlen_sdpa` switches a model
from `sdpa` to it where that is exact.

Invariants:
- A token attends to exactly the tokens of its own sequence at or before it: the same attention as sdpa with
  transformers' block-diagonal packed mask (tests/unit/test_varlen_attention.py compares them to float32
  tolerance, forward and backward, and perturbs one sequence to show the others do not see it).
- The mask function builds nothing only where the attention function confines by itself (no 2D mask, no cache
  offset, queries = keys); otherwise it is sdpa's mask function.
- Only full causal attention is switched: a model with a sliding window, attention chunks or non-"full" layer
  types keeps its implementation (and the trainer's confinement check still guards it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("asyncgrpo")

NAME = "asyncgrpo_varlen_sdpa"


def sequence_bounds(position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(starts, lengths) of the sequences of a flattened `[B, T]` packed layout: a sequence starts at every token
    whose position id is not its predecessor's + 1, and at the start of each row. `starts` index the flattened
    `B * T` tokens; both are 1-D long tensors in row order."""
    rows, width = position_ids.shape
    step = torch.ones_like(position_ids, dtype=torch.bool)
    step[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    starts = step.reshape(-1).nonzero().squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([rows * width])])
    return starts, ends - starts


def _gathers(starts: Tensor, lengths: Tensor) -> list[tuple[int, Tensor]]:
    """For each distinct sequence length L: (L, token indices `[n * L]` of its n sequences, sequence-major)."""
    out = []
    for length in torch.unique(lengths).tolist():
        firsts = starts[lengths == length]
        out.append((int(length), (firsts[:, None] + torch.arange(length, device=starts.device)).reshape(-1)))
    return out


class _Permute(torch.autograd.Function):
    """`x[order]` for a permutation `order` of dim 0, whose backward is the gather by the inverse permutation
    (index_select's own backward scatters, several times slower on CPU)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, position_ids: Tensor, *, scaling: float | None,
                     dropout: float, enable_gqa: bool) -> Tensor:
    """Causal attention confined to each packed sequence. `query` `[B, H, T, D]`, `key`/`value` `[B, Hkv, T, D]`,
    `position_ids` `[B, T]` (or `[1, T]`, broadcast); returns `[B, T, H, D]` like transformers' attention functions."""
    rows, heads, width, _ = query.shape
    starts, lengths = sequence_bounds(position_ids.expand(rows, -1))
    buckets = _gathers(starts, lengths)
    order = torch.cat([index for _, index in buckets])
    sizes = [index.numel() for _, index in buckets]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # One permutation into bucket order and contiguous splits (whose backward is one cat): per-bucket gathers would
    # each scatter a full-row gradient in the backward pass.
    split = [_Permute.apply(t.transpose(1, 2).reshape(rows * width, t.shape[1], t.shape[3]), order, inverse).split(sizes)
             for t in (query, key, value)]  # [B*T, H, D] in bucket order
    outputs = []
    for (length, _), q, k, v in zip(buckets, *split, strict=True):
        q, k, v = (t.view(-1, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=enable_gqa)
        outputs.append(attended.transpose(1, 2).reshape(-1, heads, attended.shape[3]))
    return _Permute.apply(torch.cat(outputs), inverse, order).view(rows, width, heads, -1)


def _transformers_sdpa() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., bool]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
    from transformers.masking_utils import sdpa_mask

    return sdpa_attention_forward, sdpa_mask, use_gqa_in_sdpa


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """The `AttentionInterface` function: varlen for a packed causal row, transformers' sdpa for anything else."""
    sdpa_forward, _, use_gqa_in_sdpa = _transformers_sdpa()
    position_ids = kwargs.get("position_ids")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or position_ids is None or not causal or query.shape[2] != key.shape[2] or query.shape[2] < 2:
        return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
    for unsupported in ("softcap", "position_bias", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{NAME} attention cannot apply {unsupported} = {kwargs[unsupported]!r} to packed rows; "
                             f"load {type(module).__name__} with attn_implementation='sdpa' or 'eager'")
    groups = getattr(module, "num_key_value_groups", 1)
    gqa = groups > 1 and use_gqa_in_sdpa(None, key, value)
    if groups > 1 and not gqa:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return varlen_attention(query, key, value, position_ids, scaling=scaling, dropout=dropout, enable_gqa=gqa), None


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
         attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """The `AttentionMaskInterface` function: no mask where `attention_forward` confines by itself (no 2D mask, no
    cache offset, as many queries as keys), sdpa's mask otherwise."""
    if attention_mask is None and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    _, sdpa_mask, _ = _transformers_sdpa()
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register `NAME` with transformers (idempotent; each process that builds a model calls it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask)


def only_full_causal_attention(config: Any) -> bool:
    """Whether every layer of `config`'s model is plain causal attention (no window, chunk or other layer type)."""
    if getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None:
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])


def interfaces_match() -> bool:
    """Whether the installed transformers calls attention and mask functions as this module's expect (transformers 5:
    the mask function gets `q_length`, `use_gqa_in_sdpa` takes the key and the value); 4.x differs in both."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def use_varlen_sdpa(model: Any) -> bool:
    """Switch `model` from `sdpa` to `NAME`; whether it now uses it. Other implementations (eager, flex, flash) and
    models with windowed or chunked attention keep theirs."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current != "sdpa" or not only_full_causal_attention(config) or not hasattr(model, "set_attn_implementation"):
        return False
    if not interfaces_match():  # transformers 4.x calls attention and mask functions with other signatures: keep sdpa
        return False
    register()
    model.set_attn_implementation(NAME)
    log.info("packing: %s uses %s (SDPA per packed sequence, no T x T mask), was sdpa", type(model).__name__, NAME)
    return True
