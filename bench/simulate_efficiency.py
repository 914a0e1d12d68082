"""How close the pipeline feeds the trainer to the bound min(generation, training capacity), on virtual time.

Runs `asyncgrpo simulate` on recipes/simulate.yaml (fault-free and with its faults) for each
staleness bound K and latency spread, and prints a markdown table of `efficiency` (trained
completions per virtual second over the bound) and what was wasted.

    .venv/bin/python bench/simulate_efficiency.py
"""

from __future__ import annotations

import logging
import time

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import load_config

GRID_K = (0, 1, 2, 4)
GRID_SIGMA = (0.0, 0.8)


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # the faulted rows' tolerated-failure summaries are expected
    print("| faults | latency sigma | K | efficiency | stale groups | retries | failed rollouts | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for faults in (False, True):
        for sigma in GRID_SIGMA:
            for k in GRID_K:
                overrides = [f"rollout.max_staleness={k}", f"simulate.latency_s.sigma={sigma}",
                             "generation.weight_sync_every=1", "rollout.on_stale=requeue"]  # the table's policy (before patience)
                if not faults:
                    overrides.append("simulate.faults=[]")
                started = time.perf_counter()
                report = simulate(load_config("recipes/simulate.yaml", overrides)).report()
                c = report["counters"]
                print(
                    f"| {'recipe faults' if faults else 'none'} | {sigma} | {k} | {report['efficiency']:.2f} | "
                    f"{c['rollout/stale_groups_total']} | {c['rollout/retries_total']} | {c['rollout/failed_total']} | "
                    f"{time.perf_counter() - started:.1f} |"
                )


if __name__ == "__main__":
    main()
