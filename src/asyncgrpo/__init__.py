"""asyncgrpo: asynchronous GRPO that never hangs, never loses a prompt and never trains past its staleness bound.

The Python API (docs/python_api.md) is imported on first use, so `import asyncgrpo` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncgrpo.api import Result, RunFailed, Trainer
    from asyncgrpo.api_config import build_config

__version__ = "0.1.0"
__all__ = ["Result", "RunFailed", "Trainer", "build_config"]


def __getattr__(name: str) -> Any:
    if name in ("Result", "RunFailed", "Trainer"):
        from asyncgrpo import api

        return getattr(api, name)
    if name == "build_config":
        from asyncgrpo.api_config import build_config

        return build_config
    raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
