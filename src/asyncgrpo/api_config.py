"""A run's config from what a Python caller passes: a recipe, a dict, TRL's names and Python objects.

`build_config` layers, later over earlier (a key given by two named arguments is an error, not a silent winner):
1. `config`: a recipe path (read like the CLI's), a dict (nested sections, or dotted keys), or a `Config`;
2. `args`: TRL's GRPOConfig fields (a dict, or any object with `to_dict()`, e.g. a `trl.GRPOConfig`),
   converted by trl_convert.py; what was mapped and what has no counterpart is logged;
3. the named arguments, TRL's names: `model`, `reward_funcs`, `reward_weights`, `train_dataset`,
   `eval_dataset`, `environment_factory`;
4. `overrides`: dotted keys with Python values (`{"train.max_steps": 5}`), or `cli_overrides`:
   the CLI's ``dotted.key=value`` strings (values parsed as YAML).

Objects become plain config values, so config.yaml, checkpoints and resume checks work unchanged:
- a callable reachable by import path (module level, not ``__main__``) is named ``module:qualname``;
  any other (defined in a script or notebook, a lambda, a closure, a `partial`, an instance) is
  named ``python:<name>`` and registered for the run (objects.py). Such a callable cannot reach a
  worker process: with `reward.isolation` left unset it runs in threads (`thread`), and an explicit
  `process` is a ConfigError naming the function and the fix; likewise `env.isolation: process`.
- data (a `datasets.Dataset`, or a list of dicts) is named ``python:train_dataset@<fingerprint>``
  (a SHA-256 over the rows' JSON), never a file it did not come from; since `data.source` must not
  change on resume, a resume with other rows is refused (training/resume.py). A string is a
  `data.source` as in a recipe.
- objects given as config values (`reward.functions`, `env.factory`, `data.source`, `eval.source` in a
  dict or an override) are named the same way.

Invariant: every problem is a `ConfigError` naming the argument or key, the value and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.config import Config, merge, parse_overrides, read_recipe, tolerance_warnings, validate_config
from asyncgrpo.errors import ConfigError
from asyncgrpo.objects import OBJECT_PREFIX, describe, importable_name

log = logging.getLogger("asyncgrpo")


@dataclass(frozen=True)
class Prepared:
    """A validated config and the objects its ``python:`` names stand for (registered while it runs)."""

    config: Config
    objects: dict[str, Any] = field(default_factory=dict)


def build_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
    *,
    args: Any = None,
    model: Any = None,
    reward_funcs: Any = None,
    reward_weights: list[float] | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    environment_factory: Any = None,
    overrides: Mapping[str, Any] | None = None,
    cli_overrides: list[str] | None = None,
) -> Prepared:
    """The config of the layers in the module docstring, validated, and the objects it names; warnings are logged."""
    data, source = _base(config, has_overrides=bool(overrides or cli_overrides))
    if args is not None:
        data = merge(data, _trl_args(args))
    objects: dict[str, Any] = {}
    named: dict[str, Any] = {}
    if model is not None:
        named.update(_model(model))
    if reward_funcs is not None:
        named["reward.functions"] = [_callable_spec(fn, "reward_funcs", i, objects, _reward_name) for i, fn in enumerate(_as_list(reward_funcs))]
    if reward_weights is not None:
        named["reward.weights"] = list(reward_weights)
    if train_dataset is not None:
        named["data.source"] = _data_spec(train_dataset, "train_dataset", objects)
    if eval_dataset is not None:
        named["eval.source"] = _data_spec(eval_dataset, "eval_dataset", objects)
    if environment_factory is not None:
        named["env.factory"] = _callable_spec(environment_factory, "environment_factory", None, objects, _plain_name)
    given = dotted_tree(overrides or {}, "overrides")
    for key in named:
        if _get(given, key) is not _MISSING:
            raise ConfigError(
                f"{key} is given twice: by a named argument and in the overrides. Fix: give it once."
            )
    data = merge(data, dotted_tree(named, "the named arguments"))
    data = merge(data, given)
    if cli_overrides:
        data = merge(data, parse_overrides(cli_overrides))
    _name_objects_in(data, objects)
    _choose_isolation(data, objects)
    cfg = validate_config(data, source)
    if eval_dataset is not None and not cfg.eval.every_steps:
        raise ConfigError(
            "eval_dataset is given but eval.every_steps = 0 (never evaluate), so it would not be used. Fix: set "
            "eval.every_steps (e.g. **{'eval.every_steps': 50}), or leave eval_dataset out."
        )
    for warning in tolerance_warnings(cfg):
        log.warning("warning: %s", warning)
    return Prepared(cfg, objects)


def dotted_tree(mapping: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``{"train.max_steps": 5, "rollout": {"group_size": 4}}`` as nested sections (values are kept as given)."""
    tree: dict[str, Any] = {}
    for key, value in mapping.items():
        parts = str(key).split(".")
        if any(not part for part in parts):
            raise ConfigError(f"{what}: {key!r} is not a dotted key (for example train.max_steps). Fix: name a key such as train.max_steps.")
        if isinstance(value, Mapping):
            value = dotted_tree(value, what)
        leaf: dict[str, Any] = {parts[-1]: value}
        for part in reversed(parts[:-1]):
            leaf = {part: leaf}
        tree = merge(tree, leaf)
    return tree


_MISSING = object()


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _base(config: Any, *, has_overrides: bool) -> tuple[dict[str, Any], str]:
    if config is None:
        return {}, "the Python API's config"
    if isinstance(config, (str, os.PathLike)):
        return read_recipe(Path(config), has_overrides=has_overrides), str(config)
    if isinstance(config, Config):
        return config.model_dump(mode="json"), "the given Config"
    if isinstance(config, Mapping):
        return dotted_tree(config, "config"), "the config dict"
    raise ConfigError(
        f"config = {type(config).__name__} is not a config. Fix: pass a recipe path (e.g. 'recipes/demo.yaml'), a dict of "
        f"sections or dotted keys, or an asyncgrpo Config."
    )


def _trl_args(args: Any) -> dict[str, Any]:
    """TRL's GRPOConfig fields as a recipe (trl_convert.py), with its report logged."""
    from asyncgrpo.trl_convert import convert_trl

    fields = args.to_dict() if hasattr(args, "to_dict") else args
    if not isinstance(fields, Mapping):
        raise ConfigError(
            f"args = {type(args).__name__} is not TRL's GRPOConfig or a dict of its fields. Fix: pass GRPOConfig(...), "
            f"a dict such as {{'num_generations': 8, 'learning_rate': 1e-5}}, or use config= for asyncgrpo's own keys."
        )
    conversion = convert_trl(fields)
    log.info("TRL arguments converted:\n%s", conversion.report())
    return conversion.recipe


def _model(model: Any) -> dict[str, Any]:
    if isinstance(model, (str, os.PathLike)):
        return {"model.path": str(model)}
    if isinstance(model, Mapping):
        return {f"model.{k}": v for k, v in model.items()}
    raise ConfigError(
        f"model = {describe(model)} is an object: asyncgrpo loads the model itself (the trainer and the generation engine "
        f"each hold a copy, possibly in other processes). Fix: pass a Hugging Face Hub id, a local model directory or "
        f"builtin:tiny; for a model you changed in memory, save it with model.save_pretrained(DIR) (and its tokenizer) "
        f"and pass DIR."
    )


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _reward_name(fn: Any, index: int | None) -> str:
    name = _plain_name(fn, index)
    return f"reward_{index}" if name == "lambda" else name


def _plain_name(fn: Any, _index: int | None) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial: the function it wraps
    name = getattr(inner, "__name__", None) or type(inner).__name__
    return "lambda" if name == "<lambda>" else name


def _callable_spec(fn: Any, argument: str, index: int | None, objects: dict[str, Any],
                   naming: Callable[[Any, int | None], str]) -> str:
    """The config value naming `fn`: a string as given, ``module:qualname``, or ``python:<name>`` (registered)."""
    where = f"{argument}[{index}]" if index is not None else argument
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ConfigError(
            f"{where} = {describe(fn)} is a {type(fn).__name__}, neither a callable nor a string. Fix: pass a function "
            f"(or a 'module:function' / 'builtin:<name>' string)."
        )
    spec = importable_name(fn)
    if spec is not None:
        return spec
    base = naming(fn, index)
    name, n = base, 2
    while name in objects and objects[name] is not fn:
        name, n = f"{base}_{n}", n + 1
    objects[name] = fn
    return OBJECT_PREFIX + name


def _data_spec(value: Any, argument: str, objects: dict[str, Any], role: str | None = None) -> str:
    """A data source string as given, or ``python:<role>@<fingerprint>`` for rows (registered; `role` defaults to `argument`)."""
    if isinstance(value, (str, os.PathLike)):
        return str(value)
    rows = _rows(value, argument)
    text = json.dumps(rows, sort_keys=True, default=repr, ensure_ascii=False)
    name = f"{role or argument}@{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    objects[name] = rows
    return OBJECT_PREFIX + name


def _rows(value: Any, argument: str) -> list[dict[str, Any]]:
    if hasattr(value, "to_list") and hasattr(value, "column_names"):  # datasets.Dataset
        return [dict(row) for row in value.to_list()]
    if isinstance(value, Mapping):
        splits = f" (its splits: {', '.join(map(str, value))})" if hasattr(value, "column_names") or all(
            hasattr(v, "column_names") for v in value.values()) else ""
        raise ConfigError(
            f"{argument} is a mapping{splits}, not rows. Fix: pass one split, e.g. {argument}=ds['train'], or a list of dicts."
        )
    if isinstance(value, (list, tuple)):
        for i, row in enumerate(value):
            if not isinstance(row, Mapping):
                raise ConfigError(
                    f"{argument}[{i}] is a {type(row).__name__}, not a row. Fix: pass a list of dicts such as "
                    f"[{{'prompt': '...'}}] (the prompt column is data.prompt_key), or a datasets.Dataset."
                )
        return [dict(row) for row in value]
    raise ConfigError(
        f"{argument} = {type(value).__name__} is not data asyncgrpo can read. Fix: pass a datasets.Dataset (an IterableDataset "
        f"must be materialised first: Dataset.from_list(list(it))), a list of dicts, or a data.source string (a .jsonl file, ...)."
    )


def _name_objects_in(data: dict[str, Any], objects: dict[str, Any]) -> None:
    """Objects given as values of config keys (a dict, an override) rather than by named argument are named alike."""
    reward = data.get("reward")
    if isinstance(reward, Mapping) and isinstance(reward.get("functions"), (list, tuple)):
        functions = [fn if isinstance(fn, str) else _callable_spec(fn, "reward.functions", i, objects, _reward_name)
                     for i, fn in enumerate(reward["functions"])]
        data["reward"] = {**reward, "functions": functions}
    env = data.get("env")
    if isinstance(env, Mapping) and env.get("factory") is not None and not isinstance(env["factory"], str):
        data["env"] = {**env, "factory": _callable_spec(env["factory"], "env.factory", None, objects, _plain_name)}
    for section, role in (("data", "train_dataset"), ("eval", "eval_dataset")):
        part = data.get(section)
        if isinstance(part, Mapping) and part.get("source") is not None and not isinstance(part["source"], str):
            data[section] = {**part, "source": _data_spec(part["source"], f"{section}.source", objects, role)}


def _choose_isolation(data: dict[str, Any], objects: dict[str, Any]) -> None:
    """Objects named ``python:`` cannot reach a worker process: thread isolation unless process was asked for (an error)."""
    for section, key, argument in (("reward", "functions", "reward_funcs"), ("env", "factory", "environment_factory")):
        part = data.get(section)
        if not isinstance(part, Mapping):
            continue
        specs = part.get(key)
        names = [s for s in _as_list(specs) if isinstance(s, str) and s.startswith(OBJECT_PREFIX)]
        if not names:
            continue
        isolation = part.get("isolation")
        if isolation is None:
            data[section] = {**part, "isolation": "thread"}
        elif isolation == "process":
            first = names[0]
            raise ConfigError(
                f"{section}.isolation = 'process' but {argument} includes {describe(objects.get(first[len(OBJECT_PREFIX):]))}, "
                f"which a worker process cannot import: it is defined in a script or notebook (__main__), or is a lambda, a "
                f"closure, a partial or an instance. Fix: set {section}.isolation: thread, or move the function to a module "
                f"level of an importable .py file (then it is passed by its import path)."
            )
