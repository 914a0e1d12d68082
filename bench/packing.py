"""Trainer tokens per second and peak memory, padded vs packed micro-batches (`train.micro_batch_tokens`, issue #25).

Each configuration trains `--steps` timed steps (after one warm-up step) of the same fixed batch in a fresh process
(`--one`), so its peak resident memory (ru_maxrss) is its own; the table gives tokens/s (prompt + completion tokens of
the step over the median step time), the process's peak RSS and how much of it the steps added over the loaded
model and trainer. Length distributions, per sequence:
- reasoning: completion ~ lognormal(median 300, sigma 1) capped at 4096, prompt uniform 50..150; all divided by
  `--scale` for a CPU (default 4: median 75, cap 1024);
- demo: recipes/demo.yaml's repeat_letter: prompt 7 tokens ("say x: "), completion uniform 1..12 (max_new_tokens 12).
Padded: micro-batches of `--micro-batch-size` sequences sorted by length (the trainer's default path; the demo's
own 64 for `demo`); packed: rows of at most k times the longest sequence's tokens, for each k of `--rows` (k = 1:
the longest padded row; k = the micro-batch size: the largest padded micro-batch's tokens, the same worst case).

    PYTHONPATH=src python bench/packing.py [--models builtin:tiny,builtin:smollm2-135m-instruct] [--scale 4] [--rows 1,4]

SmolLM2-135M needs its GGUF package (models/smollm2.py); without it its rows are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

GROUP_SIZE = 8
DEMO_MICRO_BATCH = 64  # recipes/demo.yaml's train.micro_batch_size


def lengths(distribution: str, sequences: int, scale: float, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, completion) token counts of `sequences` sequences."""
    rng = random.Random(f"packing:{distribution}:{seed}")
    if distribution == "demo":
        return [(7, rng.randint(1, 12)) for _ in range(sequences)]
    cap = max(1, round(4096 / scale))
    out = []
    for _ in range(sequences):
        completion = min(cap, max(1, round(math.exp(rng.gauss(math.log(300), 1.0)) / scale)))
        out.append((max(1, round(rng.randint(50, 150) / scale)), completion))
    return out


def groups_of(shape: list[tuple[int, int]], vocab: int) -> list[Any]:
    from asyncgrpo.types import Completion, Group, Prompt, Rollout

    rng = random.Random(1)
    groups = []
    for gid in range(len(shape) // GROUP_SIZE):
        rollouts = []
        members = shape[gid * GROUP_SIZE : (gid + 1) * GROUP_SIZE]
        for k, (_, completion) in enumerate(members):
            ids = tuple(rng.randrange(3, vocab) for _ in range(completion))
            comp = Completion(token_ids=ids, logprobs=(-2.0,) * completion, versions=(0,) * completion,
                              finish_reason="stop", dispatch_version=0, prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(members[k][0])))
            rollouts.append(Rollout(completion=comp, reward=float(k % 2), advantage=1.0 if k % 2 else -1.0))
        groups.append(Group(prompt=Prompt(id=gid, text="", token_ids=(1,)), rollouts=tuple(rollouts), seq=gid))
    return groups


def run_one(args: argparse.Namespace) -> None:
    """One configuration in this process: print a JSON line."""
    import torch

    from asyncgrpo.config import Config
    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.training.trainer import TorchTrainer

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model, "float32", 0)
    shape = lengths(args.distribution, args.sequences, args.scale)
    train: dict[str, Any] = {"device": "cpu", "lr": 1e-6, "micro_batch_size": micro_batch_size(args)}
    if args.mode.startswith("packed:"):
        train["micro_batch_tokens"] = int(args.mode.removeprefix("packed:")) * max(p + c - 1 for p, c in shape)
    cfg = Config.model_validate({"model": {"path": args.model}, "train": train, "rollout": {"group_size": GROUP_SIZE},
                                 "generation": {"max_new_tokens": max(c for _, c in shape)}})
    trainer = TorchTrainer(model, tokenizer, cfg)
    groups = groups_of(shape, int(model.config.vocab_size))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.train_step(groups)  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.train_step(groups)
        times.append(time.perf_counter() - start)
    tokens = sum(p + c for p, c in shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens": tokens, "step_s": statistics.median(times), "peak_mib": peak, "step_mib": peak - base,
                      "budget": train.get("micro_batch_tokens")}))


def micro_batch_size(args: argparse.Namespace) -> int:
    return DEMO_MICRO_BATCH if args.distribution == "demo" else int(args.micro_batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2-135m-instruct")
    parser.add_argument("--distributions", default="reasoning,demo")
    parser.add_argument("--scale", type=float, default=4.0, help="divide the reasoning lengths by this (CPU)")
    parser.add_argument("--sequences", type=int, default=64, help="sequences per step (a multiple of 8)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded: sequences per micro-batch")
    parser.add_argument("--rows", default="1,4", help="packed: row budgets as multiples of the longest sequence")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "DISTRIBUTION", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.model, args.distribution, args.mode = args.one
        run_one(args)
        return
    print("| model | lengths | micro-batches | tokens/step | tokens/s | speed-up | peak RSS MiB | added by the steps MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        if model == "builtin:smollm2-135m-instruct":
            from asyncgrpo.errors import ConfigError
            from asyncgrpo.models.smollm2 import check_installed

            try:
                check_installed()
            except ConfigError as error:
                print(f"skipped {model}: {error}", file=sys.stderr)
                continue
        for distribution in args.distributions.split(","):
            results = {}
            for mode in ("padded", *(f"packed:{k}" for k in args.rows.split(","))):
                command = [sys.executable, __file__, "--one", model, distribution, mode, "--scale", str(args.scale),
                           "--sequences", str(args.sequences), "--micro-batch-size", str(args.micro_batch_size),
                           "--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
                if done.returncode != 0:
                    raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
                results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            for mode, r in results.items():
                args.distribution = distribution
                cut = f"{micro_batch_size(args)} sequences" if mode == "padded" else f"{r['budget']} tokens"
                speed = r["tokens"] / r["step_s"]
                ratio = speed / (results["padded"]["tokens"] / results["padded"]["step_s"])
                label = distribution if distribution == "demo" else f"reasoning / {args.scale:g}"
                print(f"| {model} | {label} | {mode.split(':')[0]}, {cut} | {r['tokens']} | {speed:,.0f} | {ratio:.2f}x | "
                      f"{r['peak_mib']:,.0f} | {r['step_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
