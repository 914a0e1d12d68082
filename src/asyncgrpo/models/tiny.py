"""`builtin:tiny`: a ~1M-parameter Llama and a char-level tokenizer, built from a seed with no download.

Job: give tests, the demo recipe and the simulator a real causal LM that builds in well under a
second on a laptop CPU; `python -m asyncgrpo.models.tiny DIR` saves it as a model directory.

Invariants:
- Same seed -> bit-identical weights and the same tokenizer; building never touches the
  network or the global torch RNG state (the init runs under `torch.random.fork_rng`).
- The tokenizer is char-level over a compact vocabulary (`VOCAB`): the 4 specials, a-z, 0-9,
  space, the punctuation ``+-*/=?:.,!'()`` and newline. A small vocabulary lets a random policy
  already earn some reward on the built-in tasks. In-vocabulary text round-trips exactly;
  any other character (upper case included) encodes to `<unk>`.
- The tokenizer pads on the left and has a chat template ("user: ...\\nassistant: "), so
  chat-message prompts render to in-vocabulary text; an assistant message renders as
  "assistant: ...<eos>", exactly the ids of a turn that stopped on EOS.
- The model is a `LlamaForCausalLM` (so `AutoTokenizer` keeps our tokenizer; see
  research/cpu-environment.md §2) with tied embeddings, fp32.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PUNCTUATION = "+-*/=?:.,!'()"
VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + tuple(string.ascii_lowercase) + tuple(string.digits) + (" ",) + tuple(PUNCTUATION) + ("\n",)
)
# The alphabet in words, for the docs and for `check`'s warning about characters outside it.
ALPHABET = f"lowercase a-z, digits 0-9, space, newline and {PUNCTUATION}"

# An assistant message ends with <eos> (the token a turn of the model stops on) instead of a newline, so
# the ids a multi-turn episode sampled are a prefix of the template's rendering of its history (no
# re-tokenization drift; environments/conversation.py).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}assistant: {{ message['content'] }}<eos>"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

HIDDEN_SIZE = 128
NUM_LAYERS = 4
NUM_HEADS = 4
INTERMEDIATE_SIZE = 512
MAX_POSITIONS = 512


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The char-level tokenizer of `builtin:tiny` (deterministic; no seed needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config():
    """The `LlamaConfig` of `builtin:tiny` (about 1.06M parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        intermediate_size=INTERMEDIATE_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=VOCAB.index("<pad>"),
        bos_token_id=VOCAB.index("<bos>"),
        eos_token_id=VOCAB.index("<eos>"),
        dtype="float32",
    )


def build_tiny(seed: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build `builtin:tiny`: (model in eval mode, fp32, weights from `seed`; tokenizer)."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.float()
    model.eval()
    return model, build_tiny_tokenizer()


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncgrpo.models.tiny DIR [--seed N]`: write `builtin:tiny` (untrained, weights from the seed)
    to DIR as a Hugging Face model directory (config.json, safetensors, tokenizer), e.g. for
    recipes/local_model.yaml or a vLLM server."""
    import argparse

    from asyncgrpo.models.saving import save_model

    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.models.tiny", description=main.__doc__)
    parser.add_argument("directory", help="where to write the model directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0, as builtin:tiny)")
    args = parser.parse_args(argv)
    print(save_model(*build_tiny(args.seed), args.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
