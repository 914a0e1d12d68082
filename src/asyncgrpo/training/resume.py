"""Which checkpoint a run continues from, and whether this recipe may continue it. No torch: runs in preflight.

`checkpoint.resume`:
- `auto` (default): continue from the newest intact checkpoint of the run directory
  (training/integrity.py); damaged or incomplete ones are skipped with a warning naming each
  and why. With no checkpoint at all, start over; with checkpoints but none intact, refuse.
- `never`: refuse a run directory that already holds a run (unless `run.overwrite=true`).
- a path: continue from exactly that checkpoint; it must be complete. An explicit checkpoint wins
  over `run.overwrite=true` (which `make demo` always passes): a checkpoint of this run directory is
  continued and nothing is removed (starting over would delete it); one from elsewhere is continued
  after what an earlier run wrote here is removed (`ResumePlan.start_over`). A note names both keys.

A resumed run must keep what decides the data, the groups and the model; other changes
(learning rate, weight decay, warm-up, max_steps, logging...) are reported and take effect from
the first resumed step (the trainer re-applies the optimizer's hyperparameters after loading its state).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config import Config, at_new_places
from asyncgrpo.errors import ConfigError
from asyncgrpo.rundir import CHECKPOINTS_DIR, OWNED_ENTRIES
from asyncgrpo.training.integrity import CONFIG_FILE, STATE_FILE, checkpoint_problem

INCOMPATIBLE_KEYS = (
    "run.seed",
    "model.path",
    "model.dtype",
    "data.source",
    "data.prompt_key",
    "data.builtin_size",
    "data.shuffle",
    "data.max_prompt_tokens",
    "rollout.group_size",
    # The adapter's shapes and scale: its weights load only into the same LoRA, and alpha scales what they add.
    "train.lora.r",
    "train.lora.alpha",
    "train.lora.target_modules",
)
IGNORED_KEYS = ("run.overwrite", "checkpoint.resume")


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)  # the checkpoint's state.json
    changed: list[str] = field(default_factory=list)  # compatible changes, reported
    notes: list[str] = field(default_factory=list)  # skipped checkpoints, starting over
    start_over: bool = False  # remove what an earlier run wrote in the run directory before continuing `checkpoint`

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))


def plan_resume(cfg: Config) -> ResumePlan:
    run_dir = cfg.run.directory
    mode = cfg.checkpoint.resume
    if cfg.run.overwrite and mode in ("auto", "never"):
        return ResumePlan()
    if mode == "never":
        if any((run_dir / name).exists() for name in OWNED_ENTRIES):
            raise ConfigError(
                f"checkpoint.resume = 'never' but run directory {run_dir} already holds a run. Fix: pass "
                f"run.overwrite=true to replace it, checkpoint.resume=auto to continue it, or pick a new run.name."
            )
        return ResumePlan()
    if mode != "auto":
        path = Path(mode)
        problem = checkpoint_problem(path)
        if problem:
            raise ConfigError(
                f"checkpoint.resume = {mode!r} is not a checkpoint to continue from: {problem}. Fix: give a complete checkpoint "
                f"directory (runs/<name>/checkpoints/step_NNNNNN) or checkpoint.resume=auto."
            )
        if not cfg.run.overwrite:
            return _checked(cfg, path, [])
        if path.resolve().is_relative_to(run_dir.resolve()):
            note = (f"checkpoint.resume = {mode!r} with run.overwrite=true: continuing that checkpoint; run.overwrite is "
                    f"not applied, since starting over would delete it (nothing in {run_dir} is removed)")
            return _checked(cfg, path, [note])
        note = (f"checkpoint.resume = {mode!r} with run.overwrite=true: what an earlier run wrote in {run_dir} is removed, "
                f"then the run continues from that checkpoint (to start from step 0 instead, drop checkpoint.resume)")
        return replace(_checked(cfg, path, [note]), start_over=True)
    notes: list[str] = []
    parent = run_dir / CHECKPOINTS_DIR
    candidates = sorted((p for p in parent.glob("step_*") if p.is_dir()), reverse=True) if parent.is_dir() else []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            return _checked(cfg, path, notes)
        notes.append(f"skipping checkpoint {path}: {problem}")
    if candidates:
        listed = "\n".join(f"  - {note.removeprefix('skipping checkpoint ')}" for note in notes)
        raise ConfigError(
            f"run directory {run_dir} holds checkpoints, but none is intact, so this run cannot continue:\n{listed}\n"
            f"Fix: restore a checkpoint from a copy, pass checkpoint.resume=PATH to continue from another one, or "
            f"start this run over with run.overwrite=true (which removes the damaged checkpoints)."
        )
    if (run_dir / "metrics.jsonl").exists():
        notes.append(f"no checkpoint in {run_dir} yet: starting this run over from step 0")
    return ResumePlan(notes=notes)


def _checked(cfg: Config, path: Path, notes: list[str]) -> ResumePlan:
    saved = at_new_places(yaml.safe_load((path / CONFIG_FILE).read_text()))  # saved before keys moved: at their new places
    before, now = _flatten(saved), _flatten(cfg.model_dump(mode="json"))
    differences = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k) and k not in IGNORED_KEYS)
    incompatible = [k for k in differences if k in INCOMPATIBLE_KEYS]
    if incompatible:
        lines = "\n".join(f"  - {k}: {before.get(k)!r} in the checkpoint, {now.get(k)!r} now{_object_note(before.get(k), now.get(k))}"
                          for k in incompatible)
        merged = (
            f" (None: no train.lora.) A new run can start from the checkpoint's merged weights, with or "
            f"without train.lora: model.path={path}."
            if any(k.startswith("train.lora.") for k in incompatible) else ""
        )
        raise ConfigError(
            f"cannot continue {path} with this recipe: these keys decide the model, the data or the groups and must "
            f"not change on resume:\n{lines}\nFix: restore them, or start a new run (run.name=... or run.overwrite=true).{merged}"
        )
    changed = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in differences]
    state = json.loads((path / STATE_FILE).read_text())
    return ResumePlan(checkpoint=path, state=state, changed=changed, notes=notes)


def _object_note(before: Any, now: Any) -> str:
    """Why two ``python:<argument>@<fingerprint>`` data sources differ (api_config.py names data passed as objects so)."""
    if isinstance(before, str) and isinstance(now, str) and before.startswith("python:") and now.startswith("python:") and "@" in now:
        return " (the rows passed to the Python API differ from the rows this run was trained on: their fingerprints differ)"
    return ""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat
