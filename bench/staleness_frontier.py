"""The staleness policies' frontier: token efficiency vs length bias vs waste, on virtual time.

For each workload (recipes/simulate_nemo.yaml: the NeMo-comparable one with length-proportional
latency; recipes/simulate_reasoning.yaml: long-tail reasoning), each staleness bound K and each
policy (`rollout.on_stale`, with patience shares, over-admission, partial groups and resume's limits), runs
`asyncgrpo simulate` and prints a markdown table of what `simulate --json` reports: token efficiency (and its
ratio to `wait`, NeMo-RL's semantics, at the same K), length bias, wasted share of the generated tokens, the
share masked out of the loss as older than the bound (`resume`),
goodput, the share of the longest quarter of prompts dropped as stale, and the rollouts-per-second
efficiency that hides the bias. With --plot PATH it also draws the frontier (token efficiency
against length bias, one panel per workload). Figures come from one seeded run each.

    .venv/bin/python bench/staleness_frontier.py [--plot docs/img/staleness_frontier.png] [--k 0,1,2,4] [--policies "wait;resume"]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import load_config

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"nemo": ROOT / "recipes/simulate_nemo.yaml", "reasoning": ROOT / "recipes/simulate_reasoning.yaml"}
POLICIES: dict[str, list[str]] = {
    "requeue": ["rollout.on_stale=requeue"],
    "drop": ["rollout.on_stale=drop"],
    "wait": ["rollout.on_stale=wait"],
    "patience 0.5": ["rollout.on_stale=patience", "rollout.patience_share=0.5"],
    "patience 1": ["rollout.on_stale=patience", "rollout.patience_share=1"],
    "patience 2": ["rollout.on_stale=patience", "rollout.patience_share=2"],
    "patience 4": ["rollout.on_stale=patience", "rollout.patience_share=4"],
    "requeue, over-admit 4": ["rollout.on_stale=requeue", "rollout.over_admit_groups=4"],
    "patience 1, partial groups": ["rollout.on_stale=patience", "rollout.patience_share=1", "rollout.partial_groups=true"],
    # resume ({k2} is 2K, {k4} 4K): tokens past K masked; with masked share 1 no group is dropped for its masked tokens; with a
    # prefix bound, a resumed group's tokens up to 2K (4K) steps old stay in the loss, importance-weighted.
    "resume": ["rollout.on_stale=resume"],
    "resume, masked share 1": ["rollout.on_stale=resume", "rollout.max_masked_share=1"],
    "resume, prefix bound 2K": ["rollout.on_stale=resume", "rollout.max_prefix_staleness={k2}"],
    "resume, prefix bound 4K, masked share 1": ["rollout.on_stale=resume", "rollout.max_prefix_staleness={k4}",
                                                "rollout.max_masked_share=1", "rollout.max_resumptions=8"],
}


def run(workload: str, k: int, policy: str) -> dict[str, Any]:
    overrides = [o.format(k2=2 * k, k4=4 * k) for o in POLICIES[policy]]
    report = simulate(load_config(WORKLOADS[workload], [f"rollout.max_staleness={k}", *overrides])).report()
    if report["outcome"] != "completed":
        raise SystemExit(f"{workload} K={k} {policy}: the simulation ended {report['outcome']}: {report['error']}")
    generated = report["counters"]["rollout/generated_tokens_total"]
    return {
        "workload": workload, "k": k, "policy": policy,
        "token_efficiency": report["token_efficiency"], "length_bias": report["length_bias"],
        "waste": sum(report["wasted_tokens"].values()) / generated if generated else 0.0,
        "masked": report["counters"]["rollout/masked_stale_tokens_total"] / generated if generated else 0.0,
        "goodput": report["goodput"], "long_dropped": report["stale_drops_by_length_quartile"][3],
        "rollout_efficiency": report["efficiency"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="write the frontier plot (PNG) here")
    parser.add_argument("--k", default="0,1,2,4", help="staleness bounds, comma-separated")
    parser.add_argument("--policies", default=";".join(POLICIES), help="policies to run, by name, semicolon-separated (wait always runs)")
    args = parser.parse_args()
    chosen = ["wait", *(p.strip() for p in args.policies.split(";") if p.strip() != "wait")]
    if unknown := [p for p in chosen if p not in POLICIES]:
        raise SystemExit(f"--policies: unknown {unknown}; the policies are {list(POLICIES)}")
    logging.getLogger("asyncgrpo").setLevel(logging.ERROR)  # the coin reward's no-signal warning is not the point here
    started = time.perf_counter()
    rows = []
    print("| workload | K | policy | token efficiency | x wait | length bias | wasted tokens | masked tokens | goodput | "
          "longest quarter dropped | rollout efficiency |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in WORKLOADS:
        for k in (int(k) for k in args.k.split(",")):
            results = {policy: run(workload, k, policy) for policy in chosen}
            wait = results["wait"]["token_efficiency"]
            for policy, r in results.items():
                rows.append(r)
                print(f"| {workload} | {k} | {policy} | {r['token_efficiency']:.3f} | {r['token_efficiency'] / wait:.2f} | "
                      f"{r['length_bias']:.3f} | {r['waste']:.1%} | {r['masked']:.1%} | {r['goodput']:.3f} | {r['long_dropped']:.1%} | "
                      f"{r['rollout_efficiency']:.3f} |", flush=True)
    print(f"\n{len(rows)} simulations in {time.perf_counter() - started:.0f} s of wall time")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(POLICIES, "osD^v<>PXh*dp", strict=True))
    palette = {0: "#7f7f7f", 1: "#1f5fbf", 2: "#2e9e4f", 4: "#d62728", 8: "#9467bd", 16: "#8c564b"}
    colours = {k: palette.get(k, "#000000") for k in sorted({r["k"] for r in rows})}
    workloads = list(WORKLOADS)
    fig, axes = plt.subplots(1, len(workloads), figsize=(10, 4.2), sharey=True)
    for ax, workload in zip(axes, workloads):
        for r in (r for r in rows if r["workload"] == workload):
            ax.scatter(r["token_efficiency"], r["length_bias"], marker=markers[r["policy"]], color=colours[r["k"]],
                       s=20 + 200 * r["waste"], alpha=0.8, edgecolors="black", linewidths=0.4)
        ax.axhline(0.9, color="black", linewidth=0.6, linestyle=":")
        ax.set_title(f"{workload} (marker size: wasted tokens)", fontsize=9)
        ax.set_xlabel("token efficiency")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("length bias (trained / all lengths)")
    handles = [plt.Line2D([], [], marker=m, linestyle="", color="#444444", label=p) for p, m in markers.items()]
    handles += [plt.Line2D([], [], marker="s", linestyle="", color=c, label=f"K={k}") for k, c in colours.items()]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
