"""`asyncgrpo convert-trl FILE`: a GRPOConfig-shaped YAML (or JSON, or a dict) turned into a recipe, with a
report of what was mapped, what TRL value is already what asyncgrpo does, and what has no counterpart and why.

Invariants:
- Every field of the input is in exactly one list of the `Conversion` (mapped, same, unmapped).
- The mapping is trl_names.TABLE's, nothing else; two TRL fields that would set one key to different
  values (bf16 and fp16 both true) leave the second unmapped, naming the first.
- `recipe` holds only the keys the input mapped to; `check` validates it against the whole config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.errors import ConfigError
from asyncgrpo.trl_names import BY_NAME, SAME_AS_HERE, NoCounterpart, render_value, translate

# Why TRL fields outside the table have no counterpart, by name prefix (the first that matches).
_FAMILIES = (
    (("vllm_importance_sampling_cap",), "TRL deprecated it for vllm_importance_sampling_clip_max (train.loss.mismatch_clip_max here)"),
    (("vllm_server_host", "vllm_server_port"), "the servers are generation.http.base_urls, e.g. [http://HOST:PORT]"),
    (("vllm_",), "vLLM's own settings go on the vLLM server's command line (generation.backend: http)"),
    (("push_to_hub", "hub_"), "checkpoints are save_pretrained directories under the run directory: upload them with huggingface_hub"),
    (("ddp_", "fsdp", "deepspeed", "local_rank", "accelerator_config", "parallelism_config"),
     "data-parallel training is train.world_size ranks on Ray (docs/ray.md)"),
    (("dataloader_",), "the data is read once in the trainer's process"),
    (("log", "num_completions_to_print", "include_num_input_tokens_seen"),
     "every step's metrics go to metrics.jsonl and logging.sinks; completions to samples.jsonl (logging.samples_per_step)"),
    (("eval_", "per_device_eval_batch_size", "prediction_loss_only", "batch_eval_metrics", "include_for_metrics"),
     "evaluation is eval.every_steps, eval.num_prompts and eval.samples_per_prompt"),
    (("save_", "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "enable_jit_checkpoint"),
     "checkpoints are checkpoint.every_steps and checkpoint.keep_last"),
    (("entropy_", "use_adaptive_entropy", "top_entropy_quantile", "delta", "off_policy_mask_threshold", "use_bias_correction_kl",
      "sync_ref_model", "ref_model_", "multi_objective_aggregation", "cast_lm_head_to_fp32", "router_aux_loss_coef"),
     "that loss variant is not built here (docs/losses.md lists what is: TRL's loss types, importance_sampling_level, the "
     "staleness and mismatch corrections, kl_coef, and your own loss as train.loss.type: module:function)"),
)
_OTHER = "asyncgrpo has no such setting"


@dataclass
class Conversion:
    """The recipe a TRL config converts to and the report of each of its fields."""

    recipe: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, Any, str, Any]] = field(default_factory=list)  # TRL name, its value, our key, our value
    same: list[tuple[str, Any, str]] = field(default_factory=list)  # TRL name, its value, what it is here
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # TRL name, its value, why it has no counterpart

    def report(self) -> str:
        lines = [f"mapped ({len(self.mapped)}):"]
        lines += [f"  {name}: {render_value(value)} -> {ours}: {render_value(new)}" for name, value, ours, new in self.mapped]
        if self.same:
            lines.append(f"already what asyncgrpo does, nothing to set ({len(self.same)}):")
            lines += [f"  {name}: {render_value(value)} ({what})" for name, value, what in self.same]
        if self.unmapped:
            lines.append(f"no counterpart, left out ({len(self.unmapped)}):")
            lines += [f"  {name}: {render_value(value)}: {why}" for name, value, why in self.unmapped]
        return "\n".join(lines)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.recipe, sort_keys=False)


def convert_trl(trl: Mapping[str, Any]) -> Conversion:
    """Convert the fields of a GRPOConfig (as a dict: `GRPOConfig.to_dict()`, or its YAML) into a recipe."""
    out = Conversion()
    setters: dict[str, str] = {}  # our key -> the TRL field that set it
    for name, value in trl.items():
        entry = BY_NAME.get(name)
        if entry is None and (value is None or value is False):
            out.same.append((name, value, f"off in TRL, nothing to set: {_why_none(name)}"))
            continue
        if entry is None:
            out.unmapped.append((name, value, _why_none(name)))
            continue
        try:
            ours = translate(entry, value, trl)
        except NoCounterpart as exc:
            out.unmapped.append((name, value, str(exc)))
            continue
        if ours is SAME_AS_HERE or entry.ours is None:
            out.same.append((name, value, entry.note if entry.ours is None else f"{entry.ours} left at its default"))
            continue
        assert entry.ours is not None
        first = setters.get(entry.ours)
        if first is not None and _get(out.recipe, entry.ours) != ours:
            out.unmapped.append((name, value, f"{first} already set {entry.ours} to {render_value(_get(out.recipe, entry.ours))}"))
            continue
        setters[entry.ours] = name
        _set(out.recipe, entry.ours, ours)
        out.mapped.append((name, value, entry.ours, ours))
    return out


def load_trl_file(path: str | Path) -> dict[str, Any]:
    """A GRPOConfig-shaped YAML or JSON file as a dict; ConfigError if it is not one."""
    source = Path(path)
    try:
        loaded = yaml.safe_load(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source} does not exist. Fix: pass the path of a TRL GRPOConfig YAML or JSON file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source} cannot be read as text ({exc}). Fix: pass a UTF-8 YAML or JSON file.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML or JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{source} holds a {type(loaded).__name__}, not a mapping of GRPOConfig fields. Fix: give a file like "
            f"`learning_rate: 1.0e-6` / `num_generations: 8`, one field a line (GRPOConfig.to_dict() dumped as YAML or JSON)."
        )
    return loaded


def _why_none(name: str) -> str:
    for prefixes, why in _FAMILIES:
        if name.startswith(prefixes):
            return why
    return _OTHER


def _get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value
