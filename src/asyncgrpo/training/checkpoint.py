"""Checkpoints: atomic save, load, find the latest, prune.

Layout of `run_dir/checkpoints/step_{step:06d}/`:
- the model and tokenizer in the standard `save_pretrained` layout (config.json,
  model.safetensors or shards, tokenizer files): the directory loads anywhere
  transformers does (`AutoModelForCausalLM.from_pretrained(path)`); with `train.lora` this is
  the merged model, and `adapter/` holds the peft adapter (what a LoRA run resumes from);
- `trainer_state.pt`: optimizer, LR scheduler, policy version, torch RNG state; with `train.sharding: fsdp` the
  optimizer's per-parameter state is in `optimizer/` instead, each rank's shards in its own file, which
  `trainer_state.pt` names (training/sharded_state.py); `load_checkpoint` reads either at any world size;
- `run_config.yaml`: the run's resolved config;
- `records/`: copies of the run's record files (metrics.jsonl, outcomes.jsonl, timeline.jsonl) as they were
  when the checkpoint's state was taken, so a resume restores records that agree with it
  even when the live files were damaged;
- `state.json`: step, version and the caller's `extra` (counters, data cursor), written last.

Invariants:
- Atomic: everything is written into a temporary directory `.tmp-step_*` beside the final
  one, each file fsynced, then the directory is renamed into place and the parent fsynced.
  A kill at any moment leaves either the complete checkpoint or a temp dir that
  `latest_checkpoint` ignores (and the next save removes).
- `latest_checkpoint` returns only directories named `step_NNNNNN` that hold a readable
  `state.json`; the newest by step wins.
- After a save, only the `keep_last` newest checkpoints remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.atomic import atomic_directory, leftover_temporaries, library_write_errors_as_os_errors, replace_file
from asyncgrpo.training.integrity import CONFIG_FILE, RECORDS_DIR, STATE_FILE, TRAINER_STATE_FILE

if TYPE_CHECKING:  # torch is imported where it is used, so listing checkpoints stays fast
    import torch

    from asyncgrpo.training.trainer import TorchTrainer

CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
PAUSE_FOR_TESTS_ENV = "ASYNCGRPO_TEST_PAUSE_CHECKPOINT_AT_STEP"
"""Test-only hook: when set to a step, the writer of that step's checkpoint stops for good right
before the rename (after announcing it on stderr), so a test can kill the process mid-write."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def save_checkpoint(
    run_dir: Path,
    step: int,
    trainer: TorchTrainer,
    config_yaml: str,
    extra: dict[str, Any],
    *,
    records: Mapping[str, int] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write the checkpoint of `step` atomically and prune to `keep_last` (default
    `checkpoint.keep_last` of the trainer's config). Returns the checkpoint directory.

    `records` names files of `run_dir` (append-only) and how many of their bytes belong to this
    checkpoint: that prefix is copied into `records/`. Saving a step that already exists replaces it.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    keep = trainer.cfg.checkpoint.keep_last if keep_last is None else keep_last
    if keep < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep}")
    final = checkpoint_dir(run_dir, step)
    with atomic_directory(final) as tmp:
        with trainer.lock:  # weights, optimizer and version from the same moment
            with _quiet_transformers(), library_write_errors_as_os_errors(final):
                trainer.save_pretrained(tmp)
                trainer.save_trainer_state(tmp / TRAINER_STATE_FILE)  # ranks on Ray write their own (no trip to the driver)
            version = trainer.version
        if trainer.tokenizer is not None and hasattr(trainer.tokenizer, "save_pretrained"):
            trainer.tokenizer.save_pretrained(tmp)
        (tmp / CONFIG_FILE).write_text(config_yaml)
        if records:
            (tmp / RECORDS_DIR).mkdir()
            for name, size in records.items():
                _copy_prefix(Path(run_dir) / name, tmp / RECORDS_DIR / name, size)
        state = {"step": step, "version": version, "extra": extra}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
        _pause_for_tests(step, tmp)
    prune_checkpoints(run_dir, keep, protect=final)
    return final


def load_checkpoint(path: Path, trainer: TorchTrainer, *, shards_after_join: bool = False) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler, version and RNG state into `trainer`.

    `shards_after_join` (a rank about to be sharded): a sharded optimizer state's tensors are left for
    `sharded_state.read_shards` once the rank joined (each rank then reads its own shards); the rest is loaded now.
    Returns the checkpoint's `state.json` (step, version, extra).
    """
    import torch

    path = Path(path)
    state = _read_state(path)
    if state is None:
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {STATE_FILE} is missing or unreadable")
    trainer_state = torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
    if "sharded" in trainer_state["optimizer"]:  # each rank of a sharded trainer wrote its shards (training/sharded_state.py)
        from asyncgrpo.training import sharded_state

        entry = trainer_state["optimizer"]
        optimizer = sharded_state.without_tensors(entry) if shards_after_join else \
            sharded_state.read_full(path, entry, trainer.optimizer, trainer.model)
        trainer_state = {**trainer_state, "optimizer": optimizer}
    with trainer.lock:
        if trainer.lora:  # the base weights are model.path's; the adapter holds what was trained
            from asyncgrpo.training.lora import load_adapter

            load_adapter(trainer.model, path)
        else:
            load_weights(path, trainer.model)
        trainer.load_state_dict(trainer_state)
    return state


def restore_records(path: Path, run_dir: Path) -> list[str]:
    """Replace the run's record files with the copies in checkpoint `path` (each atomically).

    Returns the names restored; none for a checkpoint written before records were copied."""
    records = Path(path) / RECORDS_DIR
    if not records.is_dir():
        return []
    names = sorted(p.name for p in records.iterdir())
    for name in names:
        replace_file(Path(run_dir) / name, (records / name).read_bytes())
    return names


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under `run_dir`, or None."""
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest step first (temp and incomplete directories ignored)."""
    parent = Path(run_dir) / CHECKPOINTS_DIR
    if not parent.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for entry in parent.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and _read_state(entry) is not None:
            found.append((int(match.group(1)), entry))
    return [p for _, p in sorted(found)]


def prune_checkpoints(run_dir: Path, keep_last: int, *, protect: Path | None = None) -> list[Path]:
    """Remove all but the `keep_last` newest complete checkpoints, and leftover temp dirs.

    Returns the removed checkpoint directories.
    """
    parent = Path(run_dir) / CHECKPOINTS_DIR
    removed = []
    complete = list_checkpoints(run_dir)
    for old in complete[: max(0, len(complete) - keep_last)]:
        if protect is not None and old == protect:
            continue
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    for entry in leftover_temporaries(parent):
        shutil.rmtree(entry, ignore_errors=True)
    return removed


# -------------------------------------------------------------------------------------


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "step" in state else None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Load the safetensors weights (single file or sharded index) save_pretrained wrote into `path` (with LoRA: the
    merged model) into `model`."""
    import torch
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in shards]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} holds no model.safetensors or model.safetensors.index.json")
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        loaded.update(load_file(str(file)))
    expected = model.state_dict()
    unexpected = set(loaded) - set(expected)
    missing = set(expected) - set(loaded)
    # save_pretrained drops tied weights (e.g. lm_head.weight tied to the embeddings); those
    # are restored through the tensor they share storage with.
    loaded_ptrs = {expected[name].data_ptr() for name in set(loaded) & set(expected)}
    untied_missing = sorted(name for name in missing if expected[name].data_ptr() not in loaded_ptrs)
    if unexpected or untied_missing:
        # Names on disk differ from the module's (transformers renames some on save): let
        # transformers itself map them, then copy the result.
        from_pretrained = getattr(type(model), "from_pretrained", None)
        if from_pretrained is None:
            raise ValueError(
                f"checkpoint {path} does not match the model: unexpected {sorted(unexpected)[:5]}, "
                f"missing {untied_missing[:5]}"
            )
        with _quiet_transformers():
            reloaded = from_pretrained(path, dtype=next(model.parameters()).dtype)
        loaded = dict(reloaded.state_dict())
        model.load_state_dict(loaded, strict=True)
        return
    with torch.no_grad():
        for name, tensor in loaded.items():
            expected[name].copy_(tensor.to(expected[name].dtype))


def _copy_prefix(source: Path, target: Path, size: int) -> None:
    """Copy the first `size` bytes of the append-only `source` (a writer may be appending meanwhile)."""
    with source.open("rb") as handle:
        data = handle.read(size)
    if len(data) != size:
        raise OSError(f"{source} has {len(data)} bytes, fewer than the {size} the checkpoint's state counts")
    target.write_bytes(data)


def _pause_for_tests(step: int, tmp: Path) -> None:
    if os.environ.get(PAUSE_FOR_TESTS_ENV) == str(step):
        print(f"asyncgrpo-test: checkpoint writer paused before renaming {tmp}", file=sys.stderr, flush=True)
        threading.Event().wait()  # until the test kills the process


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while saving/loading (they would garble the run's console)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
