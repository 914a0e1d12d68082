"""training/varlen_attention.py: SDPA per packed sequence equals sdpa under a block-diagonal mask (forward and
backward, with grouped-query heads and several rows), confines each sequence (perturbing one leaves the others'
logits as they were), builds no T x T mask for a packed row, leaves padded and cached forwards as sdpa's, and is
chosen only for full causal sdpa models."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, MistralConfig
from transformers.masking_utils import create_causal_mask

from asyncgrpo.training import varlen_attention
from asyncgrpo.training.varlen_attention import NAME, sequence_bounds, use_varlen_sdpa
from asyncgrpo.training.varlen_attention import varlen_attention as attend
from tests.tiny_models import tiny_llama

# Sequence lengths 5, 3, 5, 1 | 4, 6, 3, 1: repeated lengths share one SDPA call.
POSITIONS = torch.tensor([[*range(5), *range(3), *range(5), 0], [*range(4), *range(6), *range(3), 0]])


def block_diagonal_reference(query, key, value, positions):
    """sdpa under the dense mask transformers builds for a packed row: same sequence and not in the future."""
    starts, lengths = sequence_bounds(positions)
    owner = torch.repeat_interleave(torch.arange(len(starts)), lengths).view(positions.shape)
    width = positions.shape[1]
    allowed = (owner[:, :, None] == owner[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=0.3)
    return out.transpose(1, 2)


def test_sequence_bounds_cut_each_row_at_position_resets():
    starts, lengths = sequence_bounds(POSITIONS)
    assert starts.tolist() == [0, 5, 8, 13, 14, 18, 24, 27]
    assert lengths.tolist() == [5, 3, 5, 1, 4, 6, 3, 1]
    # A row that does not restart at 0 (a continuation) is still one sequence per row.
    starts, lengths = sequence_bounds(torch.tensor([[7, 8, 9], [3, 4, 5]]))
    assert starts.tolist() == [0, 3] and lengths.tolist() == [3, 3]


def test_varlen_attention_equals_sdpa_under_the_block_diagonal_mask_forward_and_backward():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, width = 4, 2, 8, POSITIONS.shape[1]  # grouped-query: 2 query heads per key head
    tensors = [torch.randn(2, h, width, dim, generator=generator, requires_grad=True) for h in (heads, kv_heads, kv_heads)]
    weights = torch.randn(2, width, heads, dim, generator=generator)
    ours = attend(*tensors, POSITIONS, scaling=0.3, dropout=0.0, enable_gqa=True)
    (ours * weights).sum().backward()
    our_grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    reference = block_diagonal_reference(*tensors, POSITIONS)
    (reference * weights).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(our_grads, [t.grad for t in tensors], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def models():
    sdpa = tiny_llama(3).eval()
    sdpa.config._attn_implementation = "sdpa"
    varlen = copy.deepcopy(sdpa)
    assert use_varlen_sdpa(varlen) and varlen.config._attn_implementation == NAME
    return sdpa, varlen


def packed_logits(model, ids):
    return model(input_ids=ids, position_ids=POSITIONS[:1], use_cache=False).logits


def test_a_packed_sequence_gets_its_logits_alone_and_cannot_see_the_others(models):
    sdpa, varlen = models
    ids = torch.randint(3, 32, (1, POSITIONS.shape[1]), generator=torch.Generator().manual_seed(1))
    logits = packed_logits(varlen, ids)
    torch.testing.assert_close(logits, packed_logits(sdpa, ids), rtol=1e-5, atol=1e-5)
    starts, lengths = sequence_bounds(POSITIONS[:1])
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        alone = sdpa(input_ids=ids[:, start:start + length], use_cache=False).logits
        torch.testing.assert_close(logits[:, start:start + length], alone, rtol=1e-5, atol=1e-5)
    perturbed = ids.clone()
    perturbed[0, 5:8] = (perturbed[0, 5:8] + 7) % 29 + 3  # the second sequence (3 tokens), all of it
    changed = packed_logits(varlen, perturbed)
    assert (changed[0, 5:8] - logits[0, 5:8]).abs().max() > 1e-3  # the test can see a change where there is one
    torch.testing.assert_close(changed[0, :5], logits[0, :5], rtol=0, atol=1e-6)
    torch.testing.assert_close(changed[0, 8:], logits[0, 8:], rtol=0, atol=1e-6)


def test_a_packed_row_builds_no_dense_mask_and_a_padded_one_keeps_sdpas(models):
    _, varlen = models
    embeds = torch.zeros(1, POSITIONS.shape[1], 4)
    assert create_causal_mask(config=varlen.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=POSITIONS[:1]) is None
    padding = torch.tensor([[0, 0, 1, 1, 1]])
    dense = create_causal_mask(config=varlen.config, inputs_embeds=torch.zeros(1, 5, 4), attention_mask=padding, cache=None)
    assert dense is not None and dense.shape == (1, 1, 5, 5)


def test_padded_and_cached_forwards_are_sdpas(models):
    sdpa, varlen = models
    ids = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(varlen(input_ids=ids, attention_mask=padding).logits,
                               sdpa(input_ids=ids, attention_mask=padding).logits, rtol=1e-5, atol=1e-5)
    greedy = {"attention_mask": padding, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(varlen.generate(ids, **greedy), sdpa.generate(ids, **greedy))


def test_only_full_causal_sdpa_models_switch():
    eager = tiny_llama(0)
    eager.config._attn_implementation = "eager"
    assert not use_varlen_sdpa(eager) and eager.config._attn_implementation == "eager"
    assert varlen_attention.only_full_causal_attention(LlamaConfig())
    assert not varlen_attention.only_full_causal_attention(MistralConfig(sliding_window=16))
    assert not varlen_attention.only_full_causal_attention(
        LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]))


def test_a_transformers_4_install_keeps_sdpa(monkeypatch):
    """transformers 4.x (pyproject allows >= 4.56) calls mask functions and use_gqa_in_sdpa with other arguments."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    model = tiny_llama(0)
    model.config._attn_implementation = "sdpa"
    assert not use_varlen_sdpa(model) and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    assert use_varlen_sdpa(model)
