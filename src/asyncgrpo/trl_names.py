"""TRL's `GRPOConfig` names and their counterparts here: the one table behind the validator's help, the
README's mapping table (scripts/trl_table.py) and `asyncgrpo convert-trl` (trl_convert.py).

Decision: a TRL name is never a second spelling of one of our keys. A recipe or override that uses one
(bare, `num_generations=8`, or under one of our sections, `rollout.num_generations=8`) is rejected with
the exact replacement, value translated (`scale_rewards: group` -> `train.loss.scale_by_std: true`),
and `asyncgrpo convert-trl` translates a whole GRPOConfig-shaped file. One spelling per key keeps
config.yaml, resume's "changed since" check, override precedence and docs/config.md unambiguous.

Invariants:
- Imports nothing heavy (config/loading.py uses it while reporting errors); it does not import the config package.
- Every `TrlField.trl` is a field of trl's `GRPOConfig` (its `TrainingArguments` included) or of trl's
  `ModelConfig`, except those marked `older`; every `ours` is a key of `Config`
  (tests/unit/test_trl_names.py checks both against the installed trl).
- `translate` returns the value for `ours`, `SAME_AS_HERE` when the TRL value is what asyncgrpo does
  anyway (nothing to set), or raises `NoCounterpart` with the reason; it never guesses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.loss_config import BUILTIN_TYPES


class NoCounterpart(ValueError):
    """This TRL value has no counterpart here; the message says why and what to do instead."""


SAME_AS_HERE = object()  # the TRL value is asyncgrpo's behaviour: nothing to set


def _same(value: Any, trl: Mapping[str, Any]) -> Any:
    return value


def _integer(value: Any, trl: Mapping[str, Any]) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _choice(options: Mapping[Any, Any], why: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    def translate(value: Any, trl: Mapping[str, Any]) -> Any:
        for option, ours in options.items():
            if value == option and type(value) is type(option):
                return ours
        raise NoCounterpart(f"{value!r} has no counterpart here: {why}")

    return translate


def _only(expected: Any, why: str) -> Callable[[Any, Mapping[str, Any]], Any]:
    """A TRL knob with no counterpart, harmless at the value that means what asyncgrpo always does."""

    def translate(value: Any, trl: Mapping[str, Any]) -> Any:
        if value == expected or value is None:
            return SAME_AS_HERE
        raise NoCounterpart(why)

    return translate


def _off_at(*neutral: Any) -> Callable[[Any, Mapping[str, Any]], Any]:
    """A sampling knob: its neutral values (and TRL's null) are our default, anything else is the value."""

    def translate(value: Any, trl: Mapping[str, Any]) -> Any:
        return SAME_AS_HERE if value is None or value in neutral else value

    return translate


def _max_steps(value: Any, trl: Mapping[str, Any]) -> Any:
    if value == -1:
        raise NoCounterpart("-1 (train num_train_epochs) has none: train.max_steps is always a number of steps; the run also "
                            "ends when data.num_epochs are used up")
    return value


def _warmup(value: Any, trl: Mapping[str, Any]) -> Any:
    if isinstance(value, float) and 0 < value < 1:
        raise NoCounterpart(f"{value:g} is a fraction of the run; here it is a number of steps: give round({value:g} x train.max_steps)")
    return _integer(value, trl)


def _epsilon_high(value: Any, trl: Mapping[str, Any]) -> Any:
    return trl.get("epsilon", 0.2) if value is None else value  # TRL: None means epsilon


def _is_correction(trl: Mapping[str, Any]) -> bool:
    """Whether TRL applies its vLLM importance-sampling correction: only with use_vllm (a lone name, in the
    validator's help, is taken as meant)."""
    return not trl or bool(trl.get("use_vllm") and trl.get("vllm_importance_sampling_correction", True))


def _correction_objective(value: Any, trl: Mapping[str, Any]) -> Any:
    return "decoupled" if value is True and _is_correction(trl) else SAME_AS_HERE


def _correction_mode(value: Any, trl: Mapping[str, Any]) -> Any:
    return value if _is_correction(trl) else SAME_AS_HERE


def _groups_per_step(value: Any, trl: Mapping[str, Any]) -> Any:
    if value is None:
        return SAME_AS_HERE
    group = trl.get("num_generations", 8)
    if not isinstance(value, int) or not isinstance(group, int) or group < 1 or value % group:
        raise NoCounterpart(f"{value!r} completions per step is not a whole number of groups of num_generations = {group}")
    return value // group


def _report_to(value: Any, trl: Mapping[str, Any]) -> Any:
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["none"], []):
        return ["jsonl"]
    known = ("tensorboard", "wandb", "mlflow", "trackio")
    other = [n for n in names if n not in known]
    if other:
        raise NoCounterpart(f"{', '.join(map(repr, other))}: the sinks here are jsonl, {', '.join(known)}")
    return ["jsonl", *names]


def _resume(value: Any, trl: Mapping[str, Any]) -> Any:
    if value is None or value is False:
        return SAME_AS_HERE
    return "auto" if value is True else value


@dataclass(frozen=True)
class TrlField:
    """One TRL name: `ours` the dotted key it becomes (None: no counterpart), `note` what differs (or, with no
    counterpart, why), `translate` its value, `values` the TRL values it takes, for the README."""

    trl: str
    ours: str | None
    note: str = ""
    translate: Callable[[Any, Mapping[str, Any]], Any] = _same
    values: str = ""
    older: bool = False  # a name of older TRL, gone from trl 1.16's GRPOConfig


_LR_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine"}
_SINGLE_UPDATE = (
    "a step's whole batch (rollout.groups_per_step x rollout.group_size completions) is one optimizer update "
    "(train.updates_per_batch splits it), its gradients accumulated over micro-batches of train.micro_batch_size"
)
_SAMPLING = ("generation samples with temperature, top_p, top_k, min_p and repetition_penalty only (generation.temperature, "
             "generation.top_p, generation.top_k, generation.min_p, generation.repetition_penalty)")

TABLE: tuple[TrlField, ...] = (
    TrlField("model_name_or_path", "model.path", "TRL's `ModelConfig`; a local directory, a hub id or builtin:<name>"),
    TrlField("learning_rate", "train.lr"),
    TrlField("lr_scheduler_type", "train.lr_schedule", "each after `train.warmup_steps`",
             _choice(_LR_SCHEDULES, "the schedules here are constant, linear and cosine (train.lr_schedule)"),
             values="constant / constant_with_warmup, linear, cosine"),
    TrlField("warmup_steps", "train.warmup_steps", "a number of steps (TRL's fraction form has none)", _warmup),
    TrlField("weight_decay", "train.weight_decay"),
    TrlField("max_grad_norm", "train.max_grad_norm"),
    TrlField("max_steps", "train.max_steps", "always set (TRL's -1 has none); the run also ends with data.num_epochs", _max_steps),
    TrlField("num_train_epochs", "data.num_epochs", "whole epochs", _integer),
    TrlField("seed", "run.seed"),
    TrlField("output_dir", "run.output_dir"),
    TrlField("run_name", "run.name", "a plain name: the run directory defaults to runs/<run.name>"),
    TrlField("per_device_train_batch_size", "train.micro_batch_size", "sequences per forward/backward"),
    TrlField("num_generations", "rollout.group_size"),
    TrlField("num_generations_eval", "eval.samples_per_prompt", "k of pass@k"),
    TrlField("generation_batch_size", "rollout.groups_per_step", "groups, not completions: generation_batch_size / num_generations",
             _groups_per_step),
    TrlField("steps_per_generation", "train.updates_per_batch", "optimizer updates per step, each on a slice of its batch"),
    TrlField("gradient_accumulation_steps", None, _SINGLE_UPDATE, _only(1, _SINGLE_UPDATE)),
    TrlField("num_iterations", None, "each batch is trained once (μ = 1)", _only(1, "each batch is trained once (μ = 1)")),
    TrlField("max_completion_length", "generation.max_new_tokens"),
    TrlField("max_prompt_length", "data.max_prompt_tokens", "longer prompts are dropped at load, with a count", older=True),
    TrlField("temperature", "generation.temperature"),
    TrlField("top_p", "generation.top_p"),
    TrlField("top_k", "generation.top_k", "0 is off, as are TRL's null and vLLM's -1", _off_at(0, -1)),
    TrlField("min_p", "generation.min_p", "0 is off, as is TRL's null", _off_at(0.0)),
    TrlField("repetition_penalty", "generation.repetition_penalty", "1 is off", _off_at(1.0)),
    TrlField("epsilon", "train.loss.clip_low"),
    TrlField("epsilon_high", "train.loss.clip_high", "TRL's null means epsilon; under loss_type cispo it is train.loss.cispo_clip_max",
             _epsilon_high),
    TrlField("beta", "train.loss.kl_coef"),
    TrlField("loss_type", "train.loss.type", "the same names and formulas; also module:function, your own (docs/losses.md)",
             _choice({name: name for name in BUILTIN_TYPES}, f"the loss types here are {', '.join(BUILTIN_TYPES)}"),
             values=", ".join(BUILTIN_TYPES)),
    TrlField("importance_sampling_level", "train.loss.importance_sampling_level", "sequence (GSPO) with loss_type grpo, sapo or luspo"),
    TrlField("vllm_importance_sampling_correction", "train.loss.objective",
             "the objective that computes the trainer's own log-probs pi_prox the correction needs",
             _correction_objective, values="true (with use_vllm) -> decoupled"),
    TrlField("vllm_importance_sampling_mode", "train.loss.mismatch_correction",
             "on tokens of staleness 0 only; stale ones keep train.loss.is_cap (docs/losses.md)", _correction_mode,
             values="with use_vllm and the correction on"),
    TrlField("vllm_importance_sampling_clip_min", "train.loss.mismatch_clip_min"),
    TrlField("vllm_importance_sampling_clip_max", "train.loss.mismatch_clip_max", "null: no bound", lambda value, trl: value),
    *(TrlField(name, f"train.loss.{name}") for name in (
        "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    TrlField("scale_rewards", "train.loss.scale_by_std", "",
             _choice({"group": True, True: True, "none": False, False: False}, "advantages are scaled within the group or not at all"),
             values="group / true -> true, none / false -> false"),
    TrlField("mask_truncated_completions", "rollout.mask_truncated"),
    TrlField("reward_weights", "reward.weights"),
    TrlField("bf16", "train.precision", "float32 master weights; model.dtype is the serving dtype",
             _choice({True: "bfloat16", False: SAME_AS_HERE, None: SAME_AS_HERE}, "bf16 is true or false"), values="true -> bfloat16"),
    TrlField("fp16", "train.precision", "float32 master weights; model.dtype is the serving dtype",
             _choice({True: "float16", False: SAME_AS_HERE}, "fp16 is true or false"), values="true -> float16"),
    TrlField("gradient_checkpointing", "train.gradient_checkpointing"),
    TrlField("optim", "train.optimizer_state_dtype", "AdamW, its moments in float32 or bfloat16 (4 bytes/parameter less)",
             _choice({"adamw_torch": "float32", "adamw_torch_fused": "float32"},
                     "the optimizer is AdamW; train.optimizer_state_dtype: bfloat16 stores its moments in bfloat16"),
             values="adamw_torch / adamw_torch_fused -> float32"),
    TrlField("use_vllm", "generation.backend", "with generation.http.base_urls (vLLM or asyncgrpo serve)",
             _choice({True: "http", False: "local"}, "use_vllm is true or false"), values="true -> http, false -> local"),
    TrlField("vllm_server_base_url", "generation.http.base_urls", "a list: several servers",
             lambda value, trl: SAME_AS_HERE if value is None else [value]),
    TrlField("vllm_server_timeout", "generation.http.startup_timeout_s", "how long to wait at start for the servers"),
    TrlField("use_cpu", "train.device", "also generation.local.device",
             _choice({True: "cpu", False: SAME_AS_HERE}, "use_cpu is true or false"), values="true -> cpu"),
    TrlField("save_steps", "checkpoint.every_steps", "", _integer),
    TrlField("save_total_limit", "checkpoint.keep_last", "", lambda value, trl: SAME_AS_HERE if value is None else value),
    TrlField("resume_from_checkpoint", "checkpoint.resume", "auto by default: a run continues from its newest checkpoint", _resume,
             values="true -> auto, a path"),
    TrlField("eval_steps", "eval.every_steps", "0: never", lambda value, trl: SAME_AS_HERE if value is None else _integer(value, trl)),
    TrlField("shuffle_dataset", "data.shuffle"),
    TrlField("dataloader_drop_last", "data.drop_last"),
    TrlField("report_to", "logging.sinks", "metrics.jsonl is always written", _report_to,
             values="none, tensorboard, wandb, mlflow, trackio"),
    TrlField("project", "logging.project"),
    TrlField("disable_tqdm", "logging.progress", "negated",
             _choice({True: False, False: True, None: SAME_AS_HERE}, "disable_tqdm is true or false"), values="true -> false"),
    TrlField("logging_steps", None, "every step's metrics are written", _only(1, "every step's metrics are written (metrics.jsonl)")),
    TrlField("vllm_mode", None, "the vLLM servers are separate processes (generation.backend: http); the in-process engine is local",
             _only("server", "the vLLM servers are separate processes (generation.backend: http); the in-process engine is local")),
    TrlField("generation_kwargs", None, _SAMPLING, _only({}, _SAMPLING)),
)

BY_NAME: dict[str, TrlField] = {f.trl: f for f in TABLE}


def render_value(value: Any) -> str:
    """A value as written after `key=` on the command line (YAML)."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def translate(field: TrlField, value: Any, trl: Mapping[str, Any] | None = None) -> Any:
    """`field`'s value for `field.ours` (or SAME_AS_HERE); NoCounterpart when this value has none."""
    if field.ours is None:
        out = field.translate(value, trl or {})
        if out is not SAME_AS_HERE:
            raise NoCounterpart(field.note)
        return out
    if value is None and field.translate in (_same, _integer):
        return SAME_AS_HERE  # TRL's unset: ours keeps its default
    return field.translate(value, trl or {})


def trl_hint(name: str, value: Any) -> str | None:
    """The help for an unknown key `name` = `value` that is a TRL name (None if it is not): its key here and the exact
    replacement, or why it has none."""
    field = BY_NAME.get(name)
    if field is None:
        return None
    if field.ours is None:
        try:
            translate(field, value)
        except NoCounterpart:
            return f"TRL's `{name}` has no counterpart here: {field.note}. Fix: remove it."
        return f"TRL's `{name}` = {render_value(value)} is what asyncgrpo does anyway ({field.note}). Fix: remove it."
    try:
        ours = translate(field, value)
    except NoCounterpart as exc:
        return f"TRL's `{name}` is `{field.ours}` here, but {exc}. Fix: remove it, or set {field.ours} to one of its values."
    if ours is SAME_AS_HERE:
        return f"TRL's `{name}` is `{field.ours}` here, and {name} = {render_value(value)} is already what it does. Fix: remove it."
    note = f" ({field.note})" if field.note else ""
    return f"TRL's `{name}` is `{field.ours}` here{note}. Fix: replace it with {field.ours}={render_value(ours)}."
