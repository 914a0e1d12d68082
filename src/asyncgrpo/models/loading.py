"""Resolve `model.path` to a (model, tokenizer) pair.

Job: one place that knows the accepted forms of `model.path`: `builtin:<name>` (`tiny`, built from
the run seed; `smollm2-135m-instruct`, converted from an installed package, models/smollm2.py; no
download), a local Hugging Face directory, or a Hugging Face Hub id (`org/name`, not an existing
path), resolved to its snapshot directory by models/hub.py and then loaded like a local directory
(`local_files_only=True`).

Invariants:
- `check_model_path` imports no torch; it touches only the file system, and for a hub id fetches
  the config and tokenizer files (not the weights), so a wrong path or id is reported with the
  config errors, before anything heavy loads.
- A directory's tokenizer is loaded with `PreTrainedTokenizerFast` when it has tokenizer.json:
  `AutoTokenizer` may swap in a model-specific class that rewrites the pre-tokenizer
  (research/cpu-environment.md §2, the qwen2 trap).
- The returned tokenizer always has an EOS token (else ConfigError) and a pad token (EOS
  when the directory defines none).
- A directory whose weight files provide fewer than half of the architecture's tensors is
  refused (transformers would initialise the rest at random and say nothing that stops a run).
- `load_tokenizer(path)` tokenizes exactly as the tokenizer of `load_model_and_tokenizer(path)`.
- A directory written by models/saving.py's `save_model` loads with bit-identical weights and the
  same tokenization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError
from asyncgrpo.models.hub import hub_snapshot, is_hub_id

BUILTIN_MODELS = ("tiny", "smollm2-135m-instruct")
DTYPES = ("float32", "bfloat16", "float16")


def check_model_path(path: str) -> None:
    """Raise ConfigError unless `path` is a known builtin or a directory holding config.json."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            known = ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
            raise ConfigError(
                f"model.path = {path!r}: there is no built-in model named {name!r}. "
                f"Fix: use one of {known}, or the path of a local Hugging Face model directory."
            )
        if name == "smollm2-135m-instruct":
            from asyncgrpo.models.smollm2 import check_installed

            check_installed()
        return
    directory = model_directory(path, weights=False)
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.path = {path!r}: the directory has no config.json, so it is not a Hugging Face "
            f"model directory. Fix: point model.path at the directory that holds config.json, "
            f"model.safetensors and the tokenizer files (as written by save_pretrained)."
        )


def model_directory(path: str, *, weights: bool) -> Path:
    """The local directory of a `model.path` that is not a builtin: the directory itself, or a hub id's snapshot
    (its weights fetched too when `weights`); ConfigError when it is neither."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if is_hub_id(path):
        return hub_snapshot(path, weights=weights)
    raise ConfigError(
        f"model.path = {path!r}: no such directory (looked for {directory.absolute()}), and not a Hugging Face Hub id "
        f"(org/name). Fix: point model.path at a directory written by save_pretrained (holding config.json and the "
        f"weights), give a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or use builtin:tiny."
    )


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype = {dtype!r} is not supported. Fix: use one of {', '.join(DTYPES)}.")
    return getattr(torch, dtype)


def load_model_and_tokenizer(path: str, dtype: str = "float32", seed: int = 0) -> tuple[Any, Any]:
    """Return (causal LM, tokenizer) for `model.path`. `seed` initialises builtin models only."""
    check_model_path(path)
    torch_dtype = _torch_dtype(dtype)
    if path == "builtin:smollm2-135m-instruct":
        from asyncgrpo.models.smollm2 import smollm2_directory

        return load_model_and_tokenizer(str(smollm2_directory()), dtype, seed)
    if path.startswith("builtin:"):
        from asyncgrpo.models.tiny import build_tiny

        model, tokenizer = build_tiny(seed)
        return model.to(torch_dtype), tokenizer

    from transformers import AutoModelForCausalLM

    directory = model_directory(path, weights=True)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch_dtype, output_loading_info=True)
        model, info = loaded
    except Exception as exc:
        raise ConfigError(
            f"model.path = {path!r}: could not load a causal LM from this directory ({type(exc).__name__}: {exc}). "
            f"Fix: check that config.json describes a causal LM and the weight files are complete."
        ) from exc
    check_weights_matched(path, model, info)
    return model, _directory_tokenizer(path, directory)


def load_tokenizer(path: str) -> Any:
    """The tokenizer `load_model_and_tokenizer(path)` returns, without loading the weights (`check` counts prompt
    tokens with it). builtin:smollm2-135m-instruct is not converted for it: its tokenizer is read from the GGUF file
    until the converted directory exists (the tokenizer the conversion saves there)."""
    check_model_path(path)
    if path == "builtin:smollm2-135m-instruct":
        from asyncgrpo.models.smollm2 import converted_directory, gguf_tokenizer

        directory = converted_directory()
        return gguf_tokenizer() if directory is None else _directory_tokenizer(str(directory), directory)
    if path.startswith("builtin:"):
        from asyncgrpo.models.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    return _directory_tokenizer(path, model_directory(path, weights=False))


def _directory_tokenizer(path: str, directory: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if (directory / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
        else:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ConfigError(
            f"model.path = {path!r}: could not load the tokenizer from this directory ({type(exc).__name__}: {exc}). "
            f"Fix: save the tokenizer next to the model (tokenizer.save_pretrained(dir))."
        ) from exc
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"model.path = {path!r}: the tokenizer defines no EOS token, so completions could never stop. "
            f"Fix: set eos_token in {directory / 'tokenizer_config.json'}."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_weights_matched(path: str, model: Any, info: dict[str, Any]) -> None:
    """Refuse a model most of whose parameters the weight files did not provide.

    transformers initialises missing tensors at random and only logs it: a config.json of one
    architecture next to the weights of another would then train noise and exit 0."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    total = len(model.state_dict())
    if len(missing) * 2 <= total:
        return
    architecture = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
    raise ConfigError(
        f"model.path = {path!r}: the weight files provide almost none of the tensors that config.json's architecture "
        f"({architecture}, model_type {model.config.model_type!r}) needs: {len(missing)} of {total} are missing "
        f"(e.g. {', '.join(missing[:3])}) and {len(unexpected)} tensors in the files match nothing "
        f"(e.g. {', '.join(unexpected[:3]) or 'none'}). Training would start from random weights. Fix: put the "
        f"config.json that was saved with these weights next to them, or point model.path at the right directory."
    )
