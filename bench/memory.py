"""Peak memory per parameter of training + the in-process engine (docs/benchmarks.md, "Memory").

Each configuration runs in a fresh process: load the model (float32 master weights), build the
trainer and the engine's own copy in model.dtype (as `asyncgrpo train` does), then train 2 steps on
fixed synthetic groups (8 groups x 8 completions, 32 prompt + 16 completion tokens, micro-batches
of 4) and publish the weights to the engine after each. Reported: peak RSS (ru_maxrss) of the
process, (peak - RSS after imports) / parameters, the bytes each parameter costs, and the wall time of each
training step (on a shared machine: compare configurations by alternating runs).

    python bench/memory.py [--model builtin:smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

CONFIGS = {
    "fp32": {"model.dtype": "float32", "train.precision": "float32"},
    "bf16 mixed": {"model.dtype": "bfloat16", "train.precision": "bfloat16"},
    "bf16 mixed + grad ckpt": {"model.dtype": "bfloat16", "train.precision": "bfloat16", "train.gradient_checkpointing": "true"},
    "bf16 mixed + LoRA r=16": {"model.dtype": "bfloat16", "train.precision": "bfloat16", "train.lora.r": "16"},
    "bf16 mixed + bf16 AdamW state": {"model.dtype": "bfloat16", "train.precision": "bfloat16", "train.optimizer_state_dtype": "bfloat16"},
    "bf16 mixed + bf16 AdamW state + grad ckpt": {
        "model.dtype": "bfloat16", "train.precision": "bfloat16", "train.optimizer_state_dtype": "bfloat16",
        "train.gradient_checkpointing": "true",
    },
}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(model_path: str, overrides: list[str]) -> dict:
    import asyncio

    import torch

    from asyncgrpo.config import load_config
    from asyncgrpo.generation.local import LocalEngine
    from asyncgrpo.generation.serving_copy import serving_copy
    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.rollout.advantages import group_advantages
    from asyncgrpo.training.trainer import TorchTrainer
    from asyncgrpo.types import Completion, Group, Prompt, Rollout

    baseline = rss_mb()
    cfg = load_config(None, [f"model.path={model_path}", "train.micro_batch_size=4", "rollout.group_size=8", *overrides])
    model, tokenizer = load_model_and_tokenizer(cfg.model.path, "float32", 0)
    params = sum(p.numel() for p in model.parameters())
    trainer = TorchTrainer(model, tokenizer, cfg)
    engine = LocalEngine(serving_copy(trainer.base_model, trainer.generation_weights(), dtype=getattr(torch, cfg.model.dtype),
                                      device=trainer.device), tokenizer)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    groups = []
    for gid in range(8):
        rewards = [float(rng.random() < 0.5) for _ in range(7)] + [0.5]
        rollouts = tuple(
            Rollout(Completion(tuple(rng.randrange(vocab) for _ in range(16)), (-5.0,) * 16, (0,) * 16, "length", 0), r, a)
            for r, a in zip(rewards, group_advantages(rewards, scale_by_std=True))
        )
        groups.append(Group(Prompt(gid, "", tuple(rng.randrange(vocab) for _ in range(32))), rollouts, seq=gid))

    step_s = []

    async def run() -> None:
        await engine.start()
        for step in range(2):
            start = time.perf_counter()
            trainer.train_step(groups)
            step_s.append(time.perf_counter() - start)
            await engine.load_weights(trainer.generation_weights(), step + 1)
        await engine.aclose()

    asyncio.run(run())
    peak = rss_mb()
    return {"params": params, "baseline_mb": baseline, "peak_mb": peak, "bytes_per_param": (peak - baseline) * 2**20 / params,
            "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--one", nargs="*")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.one)))
        return
    print(f"model {args.model}\n| configuration | peak RSS (MB) | RSS after imports (MB) | bytes / parameter | step s |\n|---|---:|---:|---:|---|")
    for name, overrides in CONFIGS.items():
        flat = [f"{k}={v}" for k, v in overrides.items()]
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", *flat], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        steps = " ".join(f"{t:.0f}" for t in r["step_s"])
        print(f"| {name} | {r['peak_mb']:.0f} | {r['baseline_mb']:.0f} | {r['bytes_per_param']:.1f} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
