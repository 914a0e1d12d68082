"""Write a model and its tokenizer as a model directory, the layout models/loading.py reads back.

Job: `save_model` writes Hugging Face's `save_pretrained` layout (config.json, safetensors, tokenizer
files). Its own module so that models/tiny.py's `python -m asyncgrpo.models.tiny DIR` and the
loader, which builds `builtin:tiny` through models/tiny.py, do not import each other.

Invariant: `load_model_and_tokenizer` on a directory written here gives bit-identical weights and
the same tokenization (tests/unit/test_tiny_model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_model(model: Any, tokenizer: Any, directory: str | Path) -> Path:
    """Write model and tokenizer in the save_pretrained layout; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
