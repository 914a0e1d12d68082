"""Hugging Face Hub ids as `model.path` (and `distill.teacher`): `Qwen/Qwen2.5-0.5B-Instruct` resolved to a local
snapshot directory with huggingface_hub's `snapshot_download`, downloaded when online, read from the hub cache when
not.

Job: say whether a `model.path` that is not a local directory reads as a hub id, and turn a hub id into the
directory models/loading.py then loads like any local one.

Invariants:
- A string is a hub id candidate only when it is not an existing path, not absolute, not starting with `.` or `~`,
  and is exactly `org/name` of hub characters; anything else stays a (missing) local path.
- Only what loading needs is fetched: config, tokenizer and chat-template files, and (`weights=True`) the
  safetensors weights, or pytorch_model*.bin when the repository has no safetensors.
- The environment is huggingface_hub's own: HF_HOME / HF_HUB_CACHE choose the cache, HF_HUB_OFFLINE=1 forbids the
  network, HF_TOKEN authenticates. Every failure is a ConfigError naming the id, the cache directory and
  HF_HUB_OFFLINE, and (for a string that also reads as a relative path) the local directory it is not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # config, tokenizer, chat template
_WEIGHTS = ["*.safetensors"]
_LEGACY_WEIGHTS = ["pytorch_model*.bin"]


def is_hub_id(path: str) -> bool:
    """`path` reads as a hub id `org/name`: no such local path, and hub characters only."""
    return HUB_ID.fullmatch(path) is not None and not Path(path).exists()


def hub_snapshot(repo_id: str, *, weights: bool, key: str = "model.path") -> Path:
    """The local snapshot directory of hub model `repo_id`, fetching what is missing (weights too when `weights`)."""
    directory = _download(repo_id, _TOKENIZER_FILES + (_WEIGHTS if weights else []), key)
    if weights and not any(directory.glob("*.safetensors")):
        directory = _download(repo_id, _TOKENIZER_FILES + _LEGACY_WEIGHTS, key)
        if not any(directory.glob("pytorch_model*.bin")):
            raise ConfigError(
                f"{_both(repo_id, key)}: the hub snapshot at {directory} holds no weights (*.safetensors or pytorch_model*.bin). "
                f"Fix: download the complete model (online, or `hf download {repo_id}` with HF_HUB_CACHE = {_cache()}), "
                f"or point {key} at a local directory with its weights."
            )
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"{_both(repo_id, key)}: the hub snapshot at {directory} has no config.json, so it is not a transformers "
            f"model. Fix: check the id (a model repository, not a dataset or a GGUF-only repository)."
        )
    return directory


def _download(repo_id: str, patterns: list[str], key: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ConfigError(
            f"{_both(repo_id, key)}: the Hub has no model {repo_id!r} that this machine may read ({type(exc).__name__}). "
            f"Fix: check the spelling; for a gated or private model accept its terms on huggingface.co and log in "
            f"(`hf auth login`, or set HF_TOKEN)."
        ) from None
    except LocalEntryNotFoundError as exc:
        offline = _offline() or isinstance(exc.__cause__, OfflineModeIsEnabled)
        why = (
            "HF_HUB_OFFLINE=1 forbids the network" if offline
            else f"the Hub could not be reached ({_cause(exc)})"
        )
        fix = (
            f"download it once with the network (`HF_HUB_OFFLINE=0`, or `hf download {repo_id}` on a machine online, then "
            f"copy the cache), point HF_HUB_CACHE (or HF_HOME) at a cache that holds it, or give a local directory"
            if offline else
            "check the network (or a proxy), or set HF_HUB_OFFLINE=1 and point HF_HUB_CACHE (or HF_HOME) at a cache "
            "that holds it, or give a local directory"
        )
        raise ConfigError(
            f"{_both(repo_id, key)}: it is not in the hub cache ({_cache()}) and {why}. Fix: {fix}."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{_both(repo_id, key)}: fetching it from the Hub into {_cache()} failed ({type(exc).__name__}: {_short(exc)}; "
            f"HF_HUB_OFFLINE={'1' if _offline() else '0'}). Fix: retry, or download it (`hf download {repo_id}`) "
            f"and point {key} at the downloaded directory."
        ) from None


def _both(repo_id: str, key: str) -> str:
    """The value and both readings of it: not a local directory, so a hub id."""
    return (
        f"{key} = {repo_id!r} is no local directory (looked for {Path(repo_id).absolute()}), so it was read as a "
        f"Hugging Face Hub id"
    )


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cause(exc: BaseException) -> str:
    cause: Any = exc.__cause__
    return f"{type(cause).__name__}: {_short(cause)}" if cause is not None else _short(exc)


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."
