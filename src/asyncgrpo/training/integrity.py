"""Is a checkpoint directory whole? Cheap checks, made before a checkpoint is trusted. No torch.

A checkpoint can be damaged after it was written atomically: a disk error, a partial copy, a
file emptied by hand. `checkpoint_problem` reads only headers and sizes, never the tensors:

- `state.json` parses and has step, version and extra (its ledger of done ids is a mapping of
  epochs to lists of ids);
- every safetensors file (single or the shards of the index) has a header whose data offsets
  end exactly at the file's size;
- `trainer_state.pt` (a torch zip archive) has a readable central directory whose members all
  lie inside the file;
- `config.json` and `run_config.yaml` are present; `config.json` parses;
- the copies of the run's records (`records/`) are as long as the offsets the state names;
- a sharded trainer's optimizer state (`optimizer/`, training/sharded_state.py) has its manifest, and every file
  it lists has the size it lists (the manifest is written last, by rank 0, once every rank's files are written).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
TRAINER_STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "run_config.yaml"
RECORDS_DIR = "records"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
OPTIMIZER_DIR = "optimizer"  # a sharded trainer's optimizer state, one file per rank
OPTIMIZER_MANIFEST = "manifest.json"


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a checkpoint a run can continue from, or None if it is."""
    if not path.is_dir():
        return "no such directory"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (the write did not finish)"
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} is unreadable ({exc})"
    if not isinstance(state, dict) or not {"step", "version", "extra"} <= set(state):
        return f"{STATE_FILE} lacks step, version or extra"
    missing = [name for name in (CONFIG_FILE, TRAINER_STATE_FILE, "config.json") if not (path / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for check in (_ledger_problem(state), _config_problem(path), _weights_problem(path), _archive_problem(path / TRAINER_STATE_FILE),
                  _records_problem(path, state), sharded_optimizer_problem(path)):
        if check:
            return check
    return None


def _ledger_problem(state: dict[str, Any]) -> str | None:
    done = state["extra"].get("done", {}) if isinstance(state["extra"], dict) else None
    if not isinstance(done, dict) or not all(isinstance(ids, list) for ids in done.values()):
        return f"{STATE_FILE}'s ledger of done prompts is not a mapping of epochs to lists of ids"
    return None


def _config_problem(path: Path) -> str | None:
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"config.json is unreadable ({exc})"
    return None


def _weights_problem(path: Path) -> str | None:
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return f"{SAFETENSORS_INDEX} is unreadable ({exc!r})"
    elif (path / SAFETENSORS_FILE).is_file():
        shards = [SAFETENSORS_FILE]
    else:
        return f"missing {SAFETENSORS_FILE}"
    for shard in shards:
        problem = safetensors_problem(path / shard)
        if problem:
            return f"{shard}: {problem}"
    return None


def safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (header and size checked, data not read), or None."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"{size} bytes, too short for a safetensors header (empty or truncated)"
            length = int.from_bytes(head, "little")
            if 8 + length > size:
                return f"truncated: its header claims {length} bytes but the file has {size}"
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        return f"unreadable header ({exc})"
    try:
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        return "malformed header (a tensor without data_offsets)"
    expected = 8 + length + end
    if expected != size:
        return f"{size} bytes where its header describes {expected} (truncated or padded)"
    return None


def _archive_problem(file: Path) -> str | None:
    """A torch.save archive is a zip file: its central directory (at the end) must read, and its members fit."""
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{TRAINER_STATE_FILE} is not a whole archive ({size} bytes: {exc})"
    if not members or any(m.header_offset + m.compress_size > size for m in members):
        return f"{TRAINER_STATE_FILE} is truncated ({size} bytes)"
    return None


def sharded_optimizer_problem(path: Path) -> str | None:
    """Why checkpoint `path`'s sharded optimizer state (`optimizer/`, if it has one) is not whole, or None."""
    directory = path / OPTIMIZER_DIR
    if not directory.exists():
        return None  # an unsharded trainer's checkpoint: trainer_state.pt holds the state
    try:
        files = json.loads((directory / OPTIMIZER_MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{OPTIMIZER_DIR}/{OPTIMIZER_MANIFEST} is missing (the ranks' writes of the optimizer state did not all finish)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{OPTIMIZER_DIR}/{OPTIMIZER_MANIFEST} is unreadable ({exc!r})"
    for name, size in sorted(files.items()):
        file = directory / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            return f"{OPTIMIZER_DIR}/{name} " + ("is missing" if found is None else f"has {found} bytes, its manifest says {size}")
    return None


def _records_problem(path: Path, state: dict[str, Any]) -> str | None:
    offsets = state["extra"].get("offsets", {})
    records = path / RECORDS_DIR
    if not records.is_dir():
        return None  # a checkpoint written before records were copied: run.py checks the live files instead
    for file in records.iterdir():
        expected = offsets.get(file.name)
        if expected is not None and file.stat().st_size != expected:
            return f"{RECORDS_DIR}/{file.name} has {file.stat().st_size} bytes, its state says {expected}"
    return None
