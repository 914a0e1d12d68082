"""Cost of `PromptSource` with many epochs: construction and `exhausted` (read on every collector wake-up).

    PYTHONPATH=src .venv/bin/python bench/prompt_source.py [EPOCHS]
"""

from __future__ import annotations

import sys
import time

from asyncgrpo.data.source import PromptSource
from asyncgrpo.types import Prompt


def main(epochs: int) -> None:
    prompts = [Prompt(id=i, text="x", token_ids=(1,)) for i in range(64)]
    started = time.perf_counter()
    source = PromptSource(prompts, num_epochs=epochs, shuffle=True, seed=0, done={epochs - 1: [0, 1]})
    built = time.perf_counter() - started
    calls = 1000
    started = time.perf_counter()
    for _ in range(calls):
        _ = source.exhausted
    per_call = (time.perf_counter() - started) / calls
    print(f"| {epochs} | {built:.3f} | {per_call * 1e6:.2f} |")


if __name__ == "__main__":
    print("| data.num_epochs | construction s | exhausted µs/call |\n| --- | --- | --- |")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
