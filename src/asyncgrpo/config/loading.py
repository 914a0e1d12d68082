"""Loading a recipe: YAML files, dotted command-line overrides, merging, and errors that name the key and the fix.

Layering: field defaults, then the recipe file, then `key=value` overrides (values parsed as YAML, so `5`,
`true` and `[1, 2]` mean what they look like).

Invariant: `load_config` either returns a fully consistent `Config` or raises `ConfigError` whose message
lists every problem, each naming the dotted key, the value, the limit and the fix (a key that moved names its
new place, moved.py; a TRL name names its key here, trl_names.py).
"""

from __future__ import annotations

import difflib
import logging
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncgrpo.config.moved import moved_message
from asyncgrpo.config.root import Config
from asyncgrpo.errors import ConfigError
from asyncgrpo.trl_names import trl_hint

log = logging.getLogger("asyncgrpo")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["a.b=1", "c=x"] into a nested dict; values are parsed as YAML."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {item!r} is not of the form dotted.key=value (for example train.max_steps=5)."
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc.problem}).") from exc
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} was already given a plain value by another override.")
            node = child
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], override: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Deep-merge `override` into a copy of `base`; a dict replacing a plain value is an error."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and key in out and isinstance(out[key], dict):
            out[key] = merge(out[key], value, f"{prefix}{key}.")
        elif isinstance(value, dict) and key in out and out[key] is not None and not isinstance(out[key], dict):
            raise ConfigError(f"override {prefix}{key}: the recipe gives it a plain value ({out[key]!r}), not a section.")
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (or only defaults when `path` is None), apply overrides, validate everything."""
    source = "defaults"
    data: dict[str, Any] = {}
    if path is not None:
        source = str(path)
        data = read_recipe(path, has_overrides=bool(overrides))
    if overrides:
        data = merge(data, parse_overrides(overrides))
    return validate_config(data, source)


def read_recipe(path: str | Path, *, has_overrides: bool = False) -> dict[str, Any]:
    """The sections of the YAML recipe at `path`, unvalidated; every problem reading it is a ConfigError."""
    recipe = Path(path)
    if not recipe.is_file():
        raise ConfigError(f"recipe {recipe} does not exist. Fix: pass the path of a YAML recipe, e.g. recipes/demo.yaml.")
    try:
        loaded = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"recipe {recipe} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}). "
            f"Fix: save the recipe as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"recipe {recipe} cannot be read: {exc.strerror}. Fix: check its permissions.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {recipe} is not valid YAML: {exc}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {recipe} must be a mapping of sections (run:, model:, ...), got {type(loaded).__name__}.")
    if not loaded:
        # A warning, not an error: a defaults-only run (`check`, or keys given as overrides) is legitimate.
        rest = "every key not given as an override" if has_overrides else "every key"
        log.warning(
            "warning: recipe %s sets no keys (it is empty or only comments): %s is at its default. "
            "If you meant to set something, check the path and that the keys are not commented out.",
            recipe,
            rest,
        )
    return loaded


def validate_config(data: dict[str, Any], source: str = "config") -> Config:
    """`data` as a `Config`, or a ConfigError headed by `source` (the recipe) listing every problem."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise problems_error(source, [describe_error(err) for err in exc.errors(include_url=False)]) from None


def problems_error(source: str, problems: list[str]) -> ConfigError:
    """One ConfigError headed by `source` listing every problem (at least one), one line each."""
    noun = "problem" if len(problems) == 1 else "problems"
    return ConfigError(f"{source}: {len(problems)} config {noun}:\n" + "\n".join(f"  - {line}" for line in problems))


def describe_error(err: Mapping[str, Any]) -> str:
    """One pydantic error as one line: the dotted key, the value, what is wrong and the fix."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    kind = err["type"]
    value = err.get("input")
    msg = err["msg"]
    if kind == "extra_forbidden":
        moved = moved_message(key, value)
        if moved is not None:
            return moved
        trl = trl_hint(loc[-1], value)  # a TRL name, bare or under one of our sections: its key here (trl_names.py)
        if trl is not None:
            return f"{key}: unknown key. {trl}"
        known = _fields_at(loc[:-1])
        guess = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {'.'.join(loc[:-1] + [guess[0]])}?" if guess else f"known keys here: {', '.join(sorted(known))}."
        return f"{key}: unknown key. Fix: {hint}"
    if kind == "value_error" and not loc:
        return msg.removeprefix("Value error, ")
    if kind == "value_error":
        return f"{key}: {msg.removeprefix('Value error, ')}"
    if kind == "missing":
        return f"{key}: required but missing. Fix: add {key} to the recipe."
    description = _description_at(loc)
    why = f" ({description})" if description else ""
    return f"{key} = {value!r}: {msg}{why}. Fix: set {key} to a value that satisfies this."


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field's annotation: `X` or an optional `X | None` (env:, train.lora); None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in typing.get_args(annotation) else None


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        found = section_model(field.annotation)
        if found is None:
            return None
        model = found
    return model


def _fields_at(loc: list[str]) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model else []


def _description_at(loc: list[str]) -> str | None:
    model = _model_at(loc[:-1]) if loc else None
    if model is None or loc[-1] not in model.model_fields:
        return None
    return model.model_fields[loc[-1]].description
