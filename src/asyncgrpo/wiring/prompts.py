"""The prompts of a run: a training run's, tokenized, with its held-out eval prompts; the simulator's, untokenized.

Eval rows come from `eval.source`, else the built-in task's eval split, else the last `eval.num_prompts` rows
of the data, which are then left out of training (none at all when eval is off). A recipe whose held-out rows
would leave nothing to train on is a ConfigError.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.data.loading import build_prompts, read_eval_rows, read_rows
from asyncgrpo.errors import ConfigError
from asyncgrpo.pipeline import step_budget_warnings
from asyncgrpo.types import Prompt


def training_prompts(cfg: Config, tokenizer: Any) -> tuple[list[Prompt], list[Prompt], list[str]]:
    """The training and the eval prompts, tokenized with `tokenizer`, and the warnings about them (dropped
    prompts, a step budget the data cannot fill)."""
    train_rows, eval_rows = split_rows(cfg)
    tokens = {"tokenizer": tokenizer, "max_prompt_tokens": cfg.data.max_prompt_tokens}
    train_source, eval_source = prompt_sources(cfg)
    prompts, report = build_prompts(train_rows, prompt_key=cfg.data.prompt_key, source=train_source, **tokens)
    eval_key = "eval.source" if cfg.eval.source else "data.prompt_key"
    eval_prompts, eval_report = (
        build_prompts(eval_rows, prompt_key=cfg.data.prompt_key, key=eval_key, source=eval_source, **tokens) if eval_rows else ([], None)
    )
    warnings = [*report.warnings(), *(eval_report.warnings() if eval_report else []), *step_budget_warnings(cfg, len(prompts))]
    return prompts, eval_prompts, warnings


def simulation_prompts(cfg: Config) -> tuple[list[Prompt], list[str]]:
    """The simulator's prompts (no tokenizer: no token ids, no length filter) and the step budget's warnings."""
    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed)
    prompts, _ = build_prompts(rows, prompt_key=cfg.data.prompt_key, tokenizer=None, max_prompt_tokens=cfg.data.max_prompt_tokens)
    return prompts, step_budget_warnings(cfg, len(prompts))


def prompt_sources(cfg: Config) -> tuple[str, str]:
    """Where the training and the evaluation prompts come from, in words (for warnings about them)."""
    held_out = f"eval.source = {cfg.eval.source}" if cfg.eval.source else f"the eval rows of data.source = {cfg.data.source}"
    return f"data.source = {cfg.data.source}", held_out


def split_rows(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training rows and held-out eval rows (none when eval is off; see the module docstring)."""
    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed)
    n = cfg.eval.num_prompts
    if not cfg.eval.every_steps:
        return rows, []
    if cfg.eval.source is not None:
        return rows, read_eval_rows(cfg.eval.source, n=n, seed=cfg.run.seed, key="eval.source")
    if cfg.data.source.startswith("builtin:"):
        return rows, read_eval_rows(cfg.data.source, n=n, seed=cfg.run.seed, key="data.source")
    if len(rows) <= n:
        raise ConfigError(
            f"eval.num_prompts = {n} would hold out all {len(rows)} rows of data.source = {cfg.data.source!r}, "
            f"leaving nothing to train on. Fix: lower eval.num_prompts, give a separate eval.source, or set eval.every_steps=0."
        )
    return rows[:-n], rows[-n:]
