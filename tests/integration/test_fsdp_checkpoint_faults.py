"""A sharded trainer's checkpoint when a rank cannot write its optimizer shards (two CPU ranks, gloo, no Ray): the save
fails on every rank in bounded time, naming the rank, and no checkpoint is taken as complete.

- A rank that does not see the checkpoint directory (ranks on nodes without a shared file system) is named by every
  rank before anything is written: no rank waits for it.
- A rank whose write fails (here: its disk is full) is named by every rank, and no checkpoint is renamed into place.
- A rank that hangs while the others wrote their shards: they give up at the process group's timeout (which
  ray.trainer_timeout_s sets; on Ray the driver's own deadline names the silent rank, training/ray_trainer.py), and
  the directory, even with every other file of a checkpoint in it, is not whole: the optimizer state's manifest,
  written last by rank 0 once every rank's shards are there, is missing (integrity.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

from asyncgrpo.config import load_config
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.training.checkpoint import latest_checkpoint
from asyncgrpo.training.integrity import CONFIG_FILE, STATE_FILE, TRAINER_STATE_FILE, checkpoint_problem
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_groups
from tests.integration.test_fsdp import save_together

pytestmark = pytest.mark.timeout(240)

WORLD = 2
TIMEOUT_S = 5  # the process group's (ray.trainer_timeout_s on Ray)


def rank_main(rank: int, port: int, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    cfg = load_config(None, ["model.path=builtin:tiny", "train.device=cpu", "rollout.group_size=2", "runtime=ray",
                             f"train.world_size={WORLD}", "train.sharding=fsdp"])
    trainer = TorchTrainer(model, tokenizer, cfg)
    trainer.join_data_parallel(rank, WORLD)
    trainer.train_step(make_groups(model, 2, seed=1))
    outcome: dict[str, object] = {}
    try:
        save_together(trainer, rank, os.path.join(directory, "blind"), 1, cfg, elsewhere=True)
    except Exception as exc:
        outcome["blind"] = f"{type(exc).__name__}: {exc}"
    write_data = FileSystemWriter.write_data
    if rank == 1:
        def full_disk(self, plan, planner):
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = full_disk  # type: ignore[method-assign]
    try:
        save_together(trainer, rank, os.path.join(directory, "full"), 1, cfg)
    except Exception as exc:
        outcome["full"] = f"{type(exc).__name__}: {exc}"
    # The hang: the driver's steps by hand, so what is on disk when the save fails can be looked at.
    partial = Path(directory) / "partial"
    partial.mkdir(exist_ok=True)
    dist.barrier()
    trainer.save_pretrained(partial)
    if rank == 1:
        def hung(self, plan, planner):
            threading.Event().wait(TIMEOUT_S * 3)  # past every other rank's timeout
            raise TimeoutError("hung")

        FileSystemWriter.write_data = hung  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        trainer.save_trainer_state(partial / TRAINER_STATE_FILE)
    except BaseException as exc:  # noqa: BLE001 - whatever the collective raises, recorded for the test
        outcome["hang"] = (time.monotonic() - start, "".join(traceback.format_exception_only(type(exc), exc))[:500])
    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    if rank == 0:
        outcome["written"] = sorted(p.name for p in partial.iterdir())
        torch.save({}, partial / TRAINER_STATE_FILE)  # as if the writers went on regardless: every other file there
        (partial / STATE_FILE).write_text(json.dumps({"step": 1, "version": 1, "extra": {}}))
        (partial / CONFIG_FILE).write_text(cfg.model_dump_json())
        outcome["partial"] = (sorted(p.name for p in (partial / "optimizer").iterdir()), checkpoint_problem(partial))
    torch.save(outcome, os.path.join(directory, f"rank{rank}.pt"))
    os._exit(0)  # the process group is broken by the hang: no orderly teardown


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_that_cannot_write_its_optimizer_shards_fails_the_save_in_bounded_time_and_no_checkpoint_is_complete(tmp_path):
    mp.start_processes(rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    for outcome in ranks:  # every rank names the one that does not see the directory, before writing anything
        assert outcome["blind"].startswith("DiskError: trainer rank(s) 1 of 2 do not see the checkpoint directory"), outcome
        assert "file system every rank's node mounts" in outcome["blind"]
        # every rank names the one whose disk is full
        assert outcome["full"].startswith("DiskError: trainer rank(s) 1 of 2 could not write their shards"), outcome
        assert "rank 1: OSError: [Errno 28] No space left on device" in outcome["full"]
    assert latest_checkpoint(tmp_path / "blind") is None and latest_checkpoint(tmp_path / "full") is None
    assert [p.name for p in (tmp_path / "full" / "checkpoints").iterdir()] == []  # no temporary left either

    waited, error = ranks[0]["hang"]
    assert TIMEOUT_S <= waited < TIMEOUT_S + 20, (waited, error)
    files, problem = ranks[0]["partial"]
    assert TRAINER_STATE_FILE not in ranks[0]["written"] and "model.safetensors" in ranks[0]["written"]
    assert files == ["__0_0.distcp"], files  # rank 0 wrote its shards, then gave up: no DCP metadata, no manifest
    assert problem == "optimizer/manifest.json is missing (the ranks' writes of the optimizer state did not all finish)"
