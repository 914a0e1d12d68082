"""Wall time per step of the real demo training at staleness 0 (synchronous), 1 and 2, with the in-process engine
and with the HTTP backend against a separate `asyncgrpo serve` process, in one run.

Same recipe, seed and step count for each row. Beside seconds per step it reports what separates the scheduler's
effect from the machine's:
- trainer waiting: the share of the run the trainer waited for a batch (`time/trainer_wait_s`): what asynchrony
  can remove;
- generator busy: the share of the run during which at least one rollout was open (from timeline.jsonl's rollout
  spans), and the mean number open: whether the generator had work;
- CPU: this process's CPU seconds per wall second (trainer, collector and, with the local backend, the engine
  thread), and the server process's (HTTP). On 2 cores their sum cannot pass 2: when it is near 2, generation and
  training compete for the cores and more overlap cannot make steps faster; when it is far below 2, the run got
  only part of the cores (other jobs on the machine), and s/step says more about them than about the scheduler.
- CPU s per step: all the run's processes together, the work a step costs whatever the cores it got; with the
  trainer's waiting gone and this unchanged, the scheduler did its part and the rest is the cores.

    PYTHONPATH=src .venv/bin/python bench/async_speedup.py [--steps 40] [--backends local,http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config

SERVER_START_S = 120.0  # deadline for `asyncgrpo serve` to answer /health


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`asyncgrpo serve builtin:tiny` in its own process (one torch thread), until `stop()`."""

    def __init__(self, log_dir: Path, max_batch_size: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncgrpo.commands.cli", "serve", "builtin:tiny", "--port", str(self.port),
                 "--max-batch-size", str(max_batch_size)], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + SERVER_START_S
        while not self._healthy():  # an external process: polling its endpoint is the only way to see it
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"asyncgrpo serve did not start; its log:\n{self.log.read_text(errors='replace')}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def cpu_s(self) -> float:
        """utime + stime of the server process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def busy(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of `spans` was open."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def measure(k: int, steps: int, backend: str, tmp: Path) -> dict[str, float]:
    run_dir = tmp / f"{backend}-k{k}"
    overrides = [f"run.output_dir={run_dir}", "logging.progress=false", f"rollout.max_staleness={k}",
                 f"train.max_steps={steps}", "eval.every_steps=0", "checkpoint.every_steps=0",
                 "logging.timeline_max_rollouts=1000000"]
    server = None
    if backend == "http":
        cfg0 = load_config("recipes/demo.yaml", [])
        server = Server(tmp, cfg0.generation.max_inflight)
        overrides += ["generation.backend=http", f"generation.http.base_urls=[{server.url}]"]
    try:
        cfg = load_config("recipes/demo.yaml", overrides)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        server_cpu = server.cpu_s() if server else 0.0
        asyncio.run(train(cfg))
        after = resource.getrusage(resource.RUSAGE_SELF)
        server_cpu = (server.cpu_s() - server_cpu) if server else float("nan")
    finally:
        if server is not None:
            server.stop()
    run = cfg.run.directory
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    spans = [(e["start"], e["end"]) for e in events if e["e"] == "rollout"]
    step_lines = [e for e in events if e["e"] == "step"]
    t0, t1 = step_lines[0]["wait"][0], step_lines[-1]["sync"][1]  # from the first wait to the last step's end
    spans = [(max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1]
    elapsed = rows[-1]["time/elapsed_s"]
    return {
        "s_per_step": elapsed / len(rows),
        "wait_share": sum(r["time/trainer_wait_s"] for r in rows) / elapsed,
        "gen_busy": busy(spans) / (t1 - t0),
        "mean_open": sum(b - a for a, b in spans) / (t1 - t0),
        "cpu": (after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime) / elapsed,
        "server_cpu": server_cpu / elapsed,
        "cpu_per_step": (after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime + (server_cpu if server else 0.0)) / len(rows),
        "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--backends", default="local,http")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"recipes/demo.yaml (builtin:tiny, 8 groups of 8 per step, 128 requests open at most), {args.steps} steps per "
          f"row, eval and checkpoints off; http: one `asyncgrpo serve builtin:tiny` process (OMP_NUM_THREADS=1, "
          f"--max-batch-size 128) per row\n")
    print(f"| backend | max_staleness | s/step | speed-up vs K=0 | trainer waiting | generator busy | mean rollouts open | "
          f"CPU/s trainer process | CPU/s server process | CPU s per step | reward, last 10 of {args.steps} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            results = {k: measure(k, args.steps, backend, Path(tmp)) for k in (0, 1, 2)}
            base = results[0]["s_per_step"]
            for k, r in results.items():
                server = "-" if r["server_cpu"] != r["server_cpu"] else f"{r['server_cpu']:.2f}"
                print(f"| {backend} | {k} | {r['s_per_step']:.3f} | {base / r['s_per_step']:.2f}x | {r['wait_share']:.0%} | "
                      f"{r['gen_busy']:.0%} | {r['mean_open']:.1f} | {r['cpu']:.2f} | {server} | {r['cpu_per_step']:.3f} | "
                      f"{r['reward_last10']:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
