"""`distill.teacher` resolved like `model.path` (models/loading.py), with errors that name `distill.teacher`.

Job: one place where the teacher's path is checked (torch-free, with the recipe's other errors) and loaded
(the builtin tiny teacher from `distill.teacher_seed`, default run.seed + 1: another model than the student).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.errors import ConfigError
from asyncgrpo.models.loading import check_model_path, load_model_and_tokenizer


def check_teacher_path(cfg: Config) -> None:
    """ConfigError unless `distill.teacher` is a known builtin or a model directory; imports no torch."""
    with _named_teacher():
        check_model_path(cfg.distill.teacher)


def teacher_seed(cfg: Config) -> int:
    return cfg.distill.teacher_seed if cfg.distill.teacher_seed is not None else cfg.run.seed + 1


def load_teacher(cfg: Config) -> tuple[Any, Any]:
    """(teacher model in float32, its tokenizer)."""
    with _named_teacher():
        return load_model_and_tokenizer(cfg.distill.teacher, "float32", teacher_seed(cfg))


@contextlib.contextmanager
def _named_teacher() -> Iterator[None]:
    """Re-raise a model-path ConfigError with the teacher's key in place of `model.path`."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("model.path", "distill.teacher")) from exc.__cause__
