"""Wall time of one optimizer update on a model's parameters: torch AdamW vs AdamW with bfloat16 moments.

`train.optimizer_state_dtype: bfloat16` (training/bf16_adamw.py) computes each update in float32 slices
and draws rounding noise for every stored moment; this measures what that costs per step against
`torch.optim.AdamW`, on the model's own parameter shapes with fixed random gradients. The two run
alternately, round by round, so load from other jobs on a shared machine falls on both alike.

    python bench/optimizer_step.py [--model builtin:smollm2-135m-instruct] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.training.bf16_adamw import Bf16StateAdamW

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model, _ = load_model_and_tokenizer(args.model, "float32", 0)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    optimizers = {
        "AdamW (float32 moments)": torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0),
        "AdamW, bfloat16 moments": Bf16StateAdamW(params, lr=1e-6, weight_decay=0.0, seed=0),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for optimizer in optimizers.values():
        optimizer.step()  # allocates the state
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    print(f"{args.model}: {sum(p.numel() for p in params)} parameters, {torch.get_num_threads()} threads")
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} s per step ({' '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
