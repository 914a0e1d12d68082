"""`asyncgrpo check RECIPE`: everything `train` (or `simulate`) would check and read before its first step,
without loading model weights, and what it found.

It runs the command's preflight (names, paths, devices, reward functions, trackers, run directory), then
reads the data as the run would: the prompt column of every row (a wrong `data.prompt_key` fails
here, naming the columns there are), chat or plain text, how many prompts are kept and how many
dropped as too long (with the tokenizer the run uses, which loads; the weights do not), and the
eval rows. It prints the resolved settings (the trainer's device with auto resolved here) and what
the run would resume from. Any problem is the same one-paragraph config error the run would give,
before any model loads.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.algorithms.registry import algorithm_for
from asyncgrpo.config import Config, episode_limit_s
from asyncgrpo.data.loading import build_prompts, read_rows
from asyncgrpo.models.hub import is_hub_id
from asyncgrpo.models.loading import load_tokenizer, model_directory
from asyncgrpo.training.resume import ResumePlan


def check_recipe(cfg: Config) -> str:
    """Check the recipe and its data as the run would (see the module docstring); the report, as lines."""
    if cfg.generation.backend == "scripted":  # a simulate recipe
        from asyncgrpo.commands.simulate import preflight_simulation

        preflight_simulation(cfg)
        rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed)
        eval_rows: list[dict[str, Any]] = []
        plan, tokenizer = None, None
    else:
        from asyncgrpo.commands.train import preflight
        from asyncgrpo.wiring.prompts import split_rows

        plan = preflight(cfg)
        rows, eval_rows = split_rows(cfg)
        tokenizer = load_tokenizer(cfg.model.path)
    from asyncgrpo.wiring.prompts import prompt_sources

    limit, key = cfg.data.max_prompt_tokens, cfg.data.prompt_key
    train_source, eval_source = prompt_sources(cfg)
    report = build_prompts(rows, prompt_key=key, tokenizer=tokenizer, max_prompt_tokens=limit, source=train_source)[1]
    eval_key = "eval.source" if cfg.eval.source else "data.prompt_key"
    eval_prompts, eval_report = (
        build_prompts(eval_rows, prompt_key=key, tokenizer=tokenizer, max_prompt_tokens=limit, key=eval_key, source=eval_source)
        if eval_rows else ([], None)
    )
    kind = "chat messages (rendered with the tokenizer's chat template)" if report.chat else "plain text"
    lines = [
        f"data: {cfg.data.source}, column {cfg.data.prompt_key!r} holds {kind}: {report.summary()}",
        f"eval: {_eval_line(cfg, len(eval_prompts))}",
        *(f"warning: {w}" for w in [*report.warnings(), *(eval_report.warnings() if eval_report else [])]),
        *_settings(cfg),
        *([f"model.path {cfg.model.path!r} is a Hugging Face Hub id: snapshot {model_directory(cfg.model.path, weights=False)} "
           f"(train fetches its weights there if they are missing)"] if tokenizer is not None and is_hub_id(cfg.model.path) else []),
        f"run directory: {cfg.run.directory}; {_resume_line(plan)}",
    ]
    return "\n".join(lines)


def _eval_line(cfg: Config, n: int) -> str:
    if not cfg.eval.every_steps:
        return "off (eval.every_steps = 0)"
    source = cfg.eval.source or (cfg.data.source if cfg.data.source.startswith("builtin:") else "the last rows of data.source")
    k = cfg.eval.samples_per_prompt
    unit = "episode" if cfg.env is not None else "sample"  # with an env: section, evaluation plays episodes as training does
    return f"{n} prompts from {source}, every {cfg.eval.every_steps} steps and before the first, {k} {unit}{'s' if k != 1 else ''} each"


def _settings(cfg: Config) -> list[str]:
    r, g, t = cfg.rollout, cfg.generation, cfg.train
    return [
        f"model: {cfg.model.path} ({cfg.model.dtype}); {algorithm_for(cfg).describe_scoring()}",
        f"generation: {g.backend}, {g.max_new_tokens} new tokens, temperature {g.temperature:g}, at most {g.max_inflight} requests at once",
        f"rollout: {r.groups_per_step} groups of {r.group_size} per step, max_staleness {r.max_staleness}, stale groups {r.on_stale}",
        *([f"env: {cfg.env.factory}, up to {cfg.env.max_turns} turns and {cfg.env.max_tokens} tokens, {cfg.env.isolation} isolation, "
           f"each reset or step within {cfg.env.step_timeout_s:g} s, cancel grace {cfg.env.cancel_grace_s:g} s; an episode ends "
           f"within {_duration(episode_limit_s(cfg.env, g))} (the reset, then each turn's generation and step within their "
           f"deadlines)"] if cfg.env is not None else []),
        f"stall: the run fails after {_duration(cfg.stall_timeout_s)} with no rollout{' or episode turn' if cfg.env is not None else ''} "
        f"finished and no step trained (rollout.stall_timeout_s, {cfg.stall_bound()[1]})",
        f"train: {t.backend}, {t.max_steps} steps, lr {t.lr:g}, loss {t.loss.type} ({t.loss.importance_sampling_level} ratio, "
        f"{t.loss.objective}, mismatch correction {t.loss.mismatch_correction}), kl_coef {t.loss.kl_coef:g}",
        *([_hardware(cfg)] if t.backend == "torch" else []),
        f"checkpoints: {f'every {cfg.checkpoint.every_steps} steps' if cfg.checkpoint.every_steps else 'the final one only'}, "
        f"keep {cfg.checkpoint.keep_last}; "
        f"metrics to {', '.join(dict.fromkeys(['jsonl', *cfg.logging.sinks]))}",
    ]


def _duration(seconds: float) -> str:
    """`seconds` as check prints a wait: seconds, and minutes or hours when it is that long."""
    if seconds < 120:
        return f"{seconds:g} s"
    return f"{seconds:g} s ({seconds / 60:.1f} min)" if seconds < 7200 else f"{seconds:g} s ({seconds / 3600:.1f} h)"


def _hardware(cfg: Config) -> str:
    """Where and how the trainer computes: device (auto resolved on this machine), precision, schedule, memory savers."""
    from asyncgrpo.models.device import resolve_device

    t = cfg.train
    device = f"auto ({resolve_device('auto')})" if t.device == "auto" else t.device
    schedule = f"{t.lr_schedule} after {t.warmup_steps} warm-up steps" if t.warmup_steps else t.lr_schedule
    lora = f"LoRA r {t.lora.r}, alpha {t.lora.alpha:g} on {t.lora.target_modules}" if t.lora is not None else "every weight trained"
    moments = ", AdamW moments in bfloat16" if t.optimizer_state_dtype == "bfloat16" else ""
    checkpointing = ", gradient checkpointing" if t.gradient_checkpointing else ""
    return f"trainer: device {device}, {t.precision} compute on float32 weights, lr schedule {schedule}, {lora}{moments}{checkpointing}"


def _resume_line(plan: ResumePlan | None) -> str:
    if plan is None:
        return "a simulation writes nothing there (simulate --output-dir DIR writes metrics and a timeline to DIR)"
    notes = "".join(f" ({note})" for note in plan.notes)
    if plan.checkpoint is None:
        return "a fresh start" + notes
    changed = "".join(f"; changed since: {c}" for c in plan.changed)
    return f"would resume from {plan.checkpoint} (step {plan.step}){changed}{notes}"
