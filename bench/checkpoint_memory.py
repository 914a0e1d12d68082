"""Each sharded trainer rank's peak memory while it writes a checkpoint (`train.sharding: fsdp`), measured on the CPU.

Two ranks (torch.multiprocessing, gloo) of MODEL train one step (AdamW, float32 moments, so every parameter has its
state), then make the two calls a Ray rank gets for a checkpoint (training/ray_trainer.py `TrainerRank`, the very
methods): `save_pretrained` (the full weights, gathered for rank 0) and `save_trainer_state` (the optimizer state).
Before each call the rank hands its freed heap memory back to the system (malloc_trim) and resets its
resident-memory peak (/proc/self/clear_refs, 5), and reads the peak after it (VmHWM): the table shows the peak above
the resident memory before the call, per parameter of the model (the rank's own shards, held throughout, are not in it).
Then two fresh ranks resume that checkpoint as Ray ranks do (`TrainerRank(...)`, then `join`): each one's peak from
its start to the end of `join` (loading the model, the checkpoint's weights and optimizer state, sharding).

Run it once with this checkout's src and once with another's to compare them (the bench calls only what both have):

    PYTHONPATH=src:. .venv/bin/python bench/checkpoint_memory.py                      # this checkout
    PYTHONPATH=/other/checkout/src:. .venv/bin/python bench/checkpoint_memory.py      # e.g. before a change
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncgrpo.config import load_config
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.training import heap
from asyncgrpo.training.ray_trainer import TrainerRank
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_groups


def status_bytes(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024  # type: ignore[union-attr]


def peak_above(call) -> int:
    """The resident-memory peak during `call()` above the resident memory before it, in bytes (freed heap memory handed
    back to the system first, or the call would reuse it unseen)."""
    heap.release_freed_memory()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
    before = status_bytes("VmRSS")
    call()
    return status_bytes("VmHWM") - before


def rank_main(rank: int, world: int, model_path: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    model, tokenizer = load_model_and_tokenizer(model_path, "float32", 0)
    groups = make_groups(model, 1, seed=1, group_size=2)
    cfg = load_config(None, [f"model.path={model_path}", "train.device=cpu", "rollout.group_size=2", "train.loss.kl_coef=0",
                             "runtime=ray", f"train.world_size={world}", "train.sharding=fsdp"])
    trainer = TorchTrainer(model, tokenizer, cfg)
    trainer.join_data_parallel(rank, world)
    trainer.train_step(groups)
    body = SimpleNamespace(trainer=trainer, rank=rank)  # what TrainerRank's methods read of their actor
    directory = Path(out) / "checkpoint"
    directory.mkdir(exist_ok=True)
    dist.barrier()
    weights = peak_above(lambda: TrainerRank.save_pretrained(body, str(directory)))  # type: ignore[arg-type]
    dist.barrier()
    state = peak_above(lambda: TrainerRank.save_trainer_state(body, str(directory / "trainer_state.pt")))  # type: ignore[arg-type]
    dist.barrier()
    count = sum(p.numel() for p in trainer.model.parameters())
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump({"weights": weights, "state": state, "count": count}, handle)
    dist.destroy_process_group()


def resume_main(rank: int, world: int, model_path: str, port: int, out: str) -> None:
    """A Ray rank's resume of the checkpoint `rank_main` wrote (`TrainerRank`: built from it, then joined): this
    process's resident-memory peak from its start (a fresh fork) to the end of `join`."""
    torch.set_num_threads(1)
    heap.release_freed_memory()
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    cfg = load_config(None, [f"model.path={model_path}", "train.device=cpu", "rollout.group_size=2", "train.loss.kl_coef=0",
                             "runtime=ray", f"train.world_size={world}", "train.sharding=fsdp"])
    checkpoint = Path(out) / "checkpoint"
    (checkpoint / "state.json").write_text(json.dumps({"step": 1, "version": 1, "extra": {}}))  # the driver's part
    body = TrainerRank(cfg, rank, world, str(checkpoint))
    body.join(f"tcp://127.0.0.1:{port}")
    with open(os.path.join(out, f"resume{rank}.json"), "w") as handle:
        json.dump({"resume": status_bytes("VmHWM") - before}, handle)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(args.ranks, args.model, free_port(), out), nprocs=args.ranks, start_method="fork")
        mp.start_processes(resume_main, args=(args.ranks, args.model, free_port(), out), nprocs=args.ranks, start_method="fork")
        ranks = [{**json.load(open(os.path.join(out, f"{r}.json"))), **json.load(open(os.path.join(out, f"resume{r}.json")))}
                 for r in range(args.ranks)]
    print(f"{args.model}, {ranks[0]['count']:,} parameters, {args.ranks} ranks; peak resident memory above the memory before "
          f"the call, MiB (bytes per parameter)")
    print("| rank | save_pretrained | save_trainer_state | resume (whole start, from a fresh fork) |")
    print("| --- | --- | --- | --- |")
    for rank, r in enumerate(ranks):
        cells = [f"{r[k] / 2**20:.0f} ({r[k] / r['count']:.2f})" for k in ("weights", "state", "resume")]
        print(f"| {rank} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
