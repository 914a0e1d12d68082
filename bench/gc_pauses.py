"""Garbage-collection pauses during a real training run (the in-process engine, torch loaded), from gc.callbacks.

A collection runs on the thread that allocates, mostly the event loop's; a full one walks every tracked
object, and after torch, the model and the data are loaded that is hundreds of thousands. Reported over the
pipeline (from the first batch to the last step; setup, model loading and shutdown left out): collections by
generation, their CPU time (what they cost) and the longest pause in CPU and wall time (wall includes being
descheduled on a busy machine).

    PYTHONPATH=src .venv/bin/python bench/gc_pauses.py [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import tempfile
import threading
import time

import asyncgrpo.commands.train
from asyncgrpo.commands.train import train
from asyncgrpo.config import load_config


class Pauses:
    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float]] = []  # (generation, CPU s, wall s)
        self._started: dict[int, tuple[float, float]] = {}
        self.active = False  # counting only while the pipeline runs

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.active:
            return
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = (time.thread_time(), time.perf_counter())
        elif thread in self._started:
            cpu, wall = self._started.pop(thread)
            self.rows.append((info["generation"], time.thread_time() - cpu, time.perf_counter() - wall))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    pauses = Pauses()
    pipeline = asyncgrpo.commands.train.run_pipeline

    async def counted_pipeline(*a, **kw):  # the stage the collections are counted in
        pauses.active = True
        try:
            return await pipeline(*a, **kw)
        finally:
            pauses.active = False

    asyncgrpo.commands.train.run_pipeline = counted_pipeline
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("recipes/demo.yaml", [f"run.output_dir={tmp}", "logging.progress=false", f"train.max_steps={args.steps}",
                                                "eval.every_steps=0", "checkpoint.every_steps=0"])
        gc.callbacks.append(pauses)
        try:
            asyncio.run(train(cfg))
        finally:
            gc.callbacks.remove(pauses)
    print(f"recipes/demo.yaml, {args.steps} steps, local engine, eval and checkpoints off; collections while the pipeline ran\n")
    print("| generation | collections | CPU ms, total | CPU ms, longest | wall ms, longest |")
    print("| --- | --- | --- | --- | --- |")
    for generation in (0, 1, 2):
        rows = [r for r in pauses.rows if r[0] == generation]
        print(f"| {generation} | {len(rows)} | {1000 * sum(r[1] for r in rows):.0f} | {1000 * max((r[1] for r in rows), default=0):.1f} | "
              f"{1000 * max((r[2] for r in rows), default=0):.1f} |")


if __name__ == "__main__":
    main()
