"""The tiny student's KL to its teacher before and after `recipes/distill_tiny.yaml` (docs/benchmarks.md, "Distillation").

Reads a finished distill run directory: its config (student seed, teacher, temperature) and final
checkpoint. For the initial student and the trained one, samples `--prompts` completions of the run's
data at generation.temperature and reports the exact reverse KL per token, KL(student || teacher)
summed over the whole vocabulary at every sampled position (not the one-token estimate the run's
`distill/kl_mean` uses), averaged over positions.

    asyncgrpo train recipes/distill_tiny.yaml run.output_dir=runs/distill_tiny
    python bench/distill_kl.py runs/distill_tiny
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def exact_kl(student, teacher, prompts, tokenizer, temperature: float, max_new_tokens: int, seed: int) -> float:
    import torch

    rng = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in prompts:
            ids = list(ids)
            for _ in range(max_new_tokens):
                x = torch.tensor([ids])
                s = torch.log_softmax(student(input_ids=x).logits[0, -1].float() / temperature, -1)
                t = torch.log_softmax(teacher(input_ids=x).logits[0, -1].float() / temperature, -1)
                total += float((s.exp() * (s - t)).sum())
                count += 1
                token = int(torch.multinomial(s.exp(), 1, generator=rng))
                ids.append(token)
                if token == tokenizer.eos_token_id:
                    break
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo.config import load_config
    from asyncgrpo.data.loading import build_prompts, read_rows
    from asyncgrpo.distill.teacher_path import load_teacher
    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.training.checkpoint import latest_checkpoint

    torch.set_num_threads(1)  # a tiny model: more threads only contend
    cfg = load_config(args.run_dir / "config.yaml")
    initial, tokenizer = load_model_and_tokenizer(cfg.model.path, "float32", cfg.run.seed)
    trained = AutoModelForCausalLM.from_pretrained(latest_checkpoint(args.run_dir), local_files_only=True).float().eval()
    teacher, _ = load_teacher(cfg)
    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed + 99)
    prompts, _ = build_prompts(rows, prompt_key=cfg.data.prompt_key, tokenizer=tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens)
    ids = [p.token_ids for p in prompts[: args.prompts]]
    g = cfg.generation
    before = exact_kl(initial.eval(), teacher.eval(), ids, tokenizer, g.temperature, g.max_new_tokens, seed=0)
    after = exact_kl(trained, teacher.eval(), ids, tokenizer, g.temperature, g.max_new_tokens, seed=0)
    print(json.dumps({"prompts": len(ids), "kl_before": round(before, 4), "kl_after": round(after, 4), "ratio": round(after / before, 3)}))


if __name__ == "__main__":
    main()
