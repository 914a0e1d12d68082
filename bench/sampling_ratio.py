"""Mean importance ratio at staleness 0 under truncated sampling (docs/benchmarks.md, "Sampling distribution").

For each sampling setting (top-p 0.9, top-k 20, min-p 0.1, repetition penalty 1.2) and each engine (the
local engine; `asyncgrpo serve` through the HTTP backend), trains ONE synchronous step
(rollout.max_staleness 0, so every token is at staleness 0: the engine's weights are the trainer's) of
recipes/smollm2_arithmetic.yaml and reads `is_ratio/mean` and `is_ratio/max` from its metrics.jsonl.
At staleness 0 a correct pair (engine logprob and trainer logprob of the same distribution) gives 1.00;
a full-vocabulary logprob on one side and a truncated one on the other gives the kept mass S.

    python bench/sampling_ratio.py [--model builtin:smollm2-135m-instruct] [--out DIR]

A setting the code does not know (an unknown config key, a server that refuses it) is reported as
"refused", with the first line of the error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SETTINGS = {
    "top_p=0.9": ["generation.top_p=0.9"],
    "top_k=20": ["generation.top_k=20"],
    "min_p=0.1": ["generation.min_p=0.1"],
    "repetition_penalty=1.2": ["generation.repetition_penalty=1.2"],
}
COMMON = ["rollout.max_staleness=0", "train.max_steps=1", "eval.every_steps=0", "rollout.group_size=8",
          "rollout.groups_per_step=4", "generation.max_new_tokens=24", "generation.temperature=1.0"]
CLI = [sys.executable, "-c", "import sys; from asyncgrpo.commands.cli import main; sys.exit(main())"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_dir(model: str) -> str:
    if model == "builtin:smollm2-135m-instruct":
        from asyncgrpo.models.smollm2 import smollm2_directory

        return str(smollm2_directory())
    return model


class Server:
    """`asyncgrpo serve MODEL` on a free loopback port, stopped on exit."""

    def __init__(self, model: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*CLI, "serve", _model_dir(model), "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"asyncgrpo serve exited: {self.proc.stderr.read()[-2000:] if self.proc.stderr else ''}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return self
            except OSError:
                time.sleep(0.5)  # a child process's port: nothing to wait on but the socket itself
        raise RuntimeError("asyncgrpo serve did not answer /health within 300 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def one_step(recipe: str, model: str, overrides: list[str], out: Path) -> dict[str, float] | str:
    cmd = [*CLI, "train", recipe, f"model.path={model}", f"run.output_dir={out}", *COMMON, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        return "refused: " + (lines[0][:160] if lines else f"exit {done.returncode}")
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {"mean": first["is_ratio/mean"], "max": first["is_ratio/max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--recipe", default="recipes/smollm2_arithmetic.yaml")
    parser.add_argument("--engines", default="local,serve")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="sampling_ratio_"))
    rows = []
    for engine in args.engines.split(","):
        for name, overrides in SETTINGS.items():
            out = root / f"{engine}_{name}"
            if engine == "local":
                result = one_step(args.recipe, args.model, overrides, out)
            else:
                with Server(args.model) as server:
                    http = ["generation.backend=http", f"generation.http.base_urls=[{server.url}]"]
                    result = one_step(args.recipe, args.model, [*http, *overrides], out)
            rows.append((engine, name, result))
            shown = result if isinstance(result, str) else f"mean {result['mean']:.4f}  max {result['max']:.4f}"
            print(f"{engine:6s} {name:24s} {shown}", flush=True)
    print(json.dumps([{"engine": e, "setting": n, "result": r} for e, n, r in rows]))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
