"""Bytes per parameter each trainer rank holds, with and without sharding (`train.sharding`), measured on the CPU.

For 1, 2 and 4 ranks (torch.multiprocessing, gloo) of `builtin:tiny`, each rank trains one step (whole groups,
AdamW with float32 or bfloat16 moments), then makes one more backward pass so that its gradients exist, and
counts the bytes of the tensors it holds: its parameters, their gradients and AdamW's state (this rank's shards
when sharded; DDP's gradient buckets and the activations are not counted). Then projects the per-GPU memory of
1.5B / 7B / 32B models from the measured bytes per parameter (see docs/benchmarks.md for the formula).

    PYTHONPATH=src:. .venv/bin/python bench/sharding_memory.py   # src: the package; .: the tests' batch maker
    PYTHONPATH=src:. .venv/bin/python bench/sharding_memory.py --lora 16 --moments float32   # LoRA: frozen base + adapters
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncgrpo.config import load_config
from asyncgrpo.models.loading import load_model_and_tokenizer
from asyncgrpo.training.bf16_adamw import local
from asyncgrpo.training.trainer import TorchTrainer
from tests.component.test_trainer import make_groups

MODELS = {"1.5B": 1.54e9, "7B": 7.62e9, "32B": 32.8e9}  # Qwen2.5 sizes


def held(trainer: TorchTrainer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state tensors."""
    params = list(trainer.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {name: sum(local(t).numel() * t.element_size() for t in tensors)
            for name, tensors in (("params", params), ("grads", grads), ("optimizer", state))}


def rank_main(rank: int, world: int, sharding: str, moments: str, port: int, out: str, lora: int) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer("builtin:tiny", "float32", 0)
    groups = make_groups(model, 4, seed=1)
    overrides = ["model.path=builtin:tiny", "train.device=cpu", "rollout.group_size=4", f"train.optimizer_state_dtype={moments}"]
    overrides += [f"train.lora.r={lora}"] if lora else []
    if world > 1:
        overrides += ["runtime=ray", f"train.world_size={world}", f"train.sharding={sharding}"]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    trainer = TorchTrainer(model, tokenizer, load_config(None, overrides))
    if world > 1:
        trainer.join_data_parallel(rank, world)
    trainer.train_step(groups)
    ids = torch.tensor([[1, 5, 7, 9]])
    (trainer.model(input_ids=ids).logits.sum() * 0.0).backward()  # gradients exist (sharded: reduce-scattered)
    count = sum(p.numel() for p in trainer.model.parameters()) if world == 1 else None
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump({"held": held(trainer), "count": count}, handle)
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(world: int, sharding: str, moments: str, lora: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(world, sharding, moments, free_port(), out, lora), nprocs=world, start_method="fork")
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--lora", type=int, default=0, help="train.lora.r (0: no LoRA, every weight trains)")
    parser.add_argument("--moments", default="float32,bfloat16")
    args = parser.parse_args()
    print("| sharding | ranks | AdamW moments | parameters | gradients | optimizer state | total, bytes/parameter per rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    per_param: dict[tuple[str, int, str], float] = {}
    count = None
    for moments in args.moments.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for sharding in (("ddp", "fsdp") if world > 1 else ("none",)):
                ranks = measure(world, sharding, moments, args.lora)
                count = count or ranks[0]["count"]
                worst = max(ranks, key=lambda r: sum(r["held"].values()))["held"]  # the rank holding the most
                parts = [worst[k] / count for k in ("params", "grads", "optimizer")]
                per_param[(sharding, world, moments)] = sum(parts)
                print(f"| {sharding} | {world} | {moments} | " + " | ".join(f"{p:.2f}" for p in parts) + f" | {sum(parts):.2f} |")
    print(f"\n({count:,} parameters.) Projected GiB per GPU of weights, gradients and AdamW state (no activations, "
          f"no gathered layers in flight):\n")
    print("| sharding | ranks | AdamW moments | " + " | ".join(MODELS) + " |")
    print("| --- | --- | --- |" + " --- |" * len(MODELS))
    for (sharding, world, moments), per in per_param.items():
        print(f"| {sharding} | {world} | {moments} | " + " | ".join(f"{n * per / 2**30:.1f}" for n in MODELS.values()) + " |")

if __name__ == "__main__":
    main()
