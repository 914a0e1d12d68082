"""builtin:tiny (seeded, no download) and the model loading/saving layer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.errors import ConfigError
from asyncgrpo.models.loading import check_model_path, load_model_and_tokenizer, save_model
from asyncgrpo.models.tiny import VOCAB, build_tiny, build_tiny_tokenizer


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_same_seed_gives_bit_identical_weights_and_leaves_global_rng_alone():
    before = torch.random.get_rng_state()
    a, _ = build_tiny(3)
    b, _ = build_tiny(3)
    c, _ = build_tiny(4)
    assert torch.equal(before, torch.random.get_rng_state())
    assert same_weights(a, b)
    assert not same_weights(a, c)


def test_about_one_million_fp32_parameters_with_tied_embeddings():
    model, tokenizer = build_tiny(0)
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n <= 2_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.config.vocab_size == len(VOCAB) == len(tokenizer)


def test_tokenizer_round_trips_in_vocab_text_char_by_char():
    tokenizer = build_tiny_tokenizer()
    text = "what is 12+30*(4-1)/2? answer: it's 57.5, ok!\nnext = line"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids
    assert tokenizer("aXb")["input_ids"] == [VOCAB.index("a"), tokenizer.unk_token_id, VOCAB.index("b")]
    assert tokenizer.padding_side == "left"
    assert {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token} == {"<pad>", "<bos>", "<eos>", "<unk>"}
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(ids + [eos], skip_special_tokens=True) == text


def test_chat_template_renders_in_vocab_text():
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: be brief.\nuser: 2+2?\nassistant: "
    assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"]


def test_save_then_load_gives_identical_weights_and_tokenization(tmp_path):
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", seed=7)
    save_model(model, tokenizer, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
    check_model_path(str(tmp_path / "m"))
    loaded, loaded_tok = load_model_and_tokenizer(str(tmp_path / "m"), "float32", seed=999)  # seed unused for dirs
    assert same_weights(model, loaded)
    text = "user: 17-4?\nassistant: 13"
    assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi\n"
    assert (loaded_tok.eos_token_id, loaded_tok.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    assert same_weights(model, plain)


def test_bfloat16_dtype_is_applied(tmp_path):
    model, _ = load_model_and_tokenizer("builtin:tiny", "bfloat16", seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    model, tokenizer = build_tiny(0)
    save_model(model, tokenizer, tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("pad_token", None)
    config_path.write_text(json.dumps(config))
    _, loaded_tok = load_model_and_tokenizer(str(tmp_path), "float32", 0)
    assert loaded_tok.pad_token_id == loaded_tok.eos_token_id == tokenizer.eos_token_id


def test_bad_model_paths_raise_config_errors_naming_key_value_and_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path = 'builtin:huge'.*builtin:tiny"):
        check_model_path("builtin:huge")
    with pytest.raises(ConfigError, match=r"model\.path = .*no such directory.*Fix"):
        check_model_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"model\.path = .*no config\.json.*Fix"):
        check_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="model.path"):
        load_model_and_tokenizer(str(tmp_path), "float32", 0)


def test_weights_that_match_nothing_in_the_architecture_are_refused_naming_both(tmp_path):
    from transformers import GPT2Config

    model, tokenizer = build_tiny(0)
    save_model(model, tokenizer, tmp_path)  # Llama weights ...
    GPT2Config(vocab_size=len(VOCAB), n_embd=32, n_layer=2, n_head=2).save_pretrained(tmp_path)  # ... under a GPT-2 config
    with pytest.raises(ConfigError) as info:
        load_model_and_tokenizer(str(tmp_path))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "'gpt2'" in message
    assert "model.layers.0" in message and "are missing" in message and "Fix:" in message
