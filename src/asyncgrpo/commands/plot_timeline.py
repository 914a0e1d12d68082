"""timeline.png and timeline_start.png of `asyncgrpo plot`: the pipeline, drawn from `timeline.jsonl`.

The top panel shows the generation side. Up to `BARS_MAX` rollouts in the drawn window it is one
bar per rollout (a lane is a generation slot, each bar coloured by what became of its group:
trained, stale-cancelled, failed, dropped, unfinished at exit). Past that, bars are a wall of
colour, so the panel becomes two: in-flight bands (how many rollouts were open, on average over
each bin, stacked by what became of them) and rates (rollouts started, finished, failed and cancelled per
second, in `BINS` bins; a rate that stays 0 is left out). The bottom panel is the trainer's lane:
each step's wait, training and weight sync, and the evaluations.

Invariants: the in-flight bands count exactly the rollouts the bars would draw (same fates), so
their top edge is the mean number of open rollouts in each bin (their area: rollout-seconds);
rates count each rollout once, in the bin of its start (started) or of its end (its outcome).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Any

COLOURS = {
    "trained": "#2e9e4f",
    "stale": "#f0a020",
    "failed": "#d62728",
    "dropped": "#7f7f7f",
    "unfinished": "#c7c7c7",
    "wait": "#dddddd",
    "train": "#1f5fbf",
    "sync": "#9467bd",
    "eval": "#17becf",
}
FATES = ("trained", "stale", "failed", "dropped", "unfinished")
BARS_MAX = 300  # rollouts in the window up to which each gets its own bar
BINS = 120  # time bins of the aggregated view


class Pipeline:
    """The timeline's rollouts packed into lanes (a lane is a generation slot), and the trainer's spans."""

    def __init__(self, bars: list[tuple[int, float, float, str, str]], trainer: list[tuple[str, float, float]], lanes: int,
                 end: float, max_inflight: int, unrecorded: int) -> None:
        self.bars, self.trainer, self.lanes, self.end = bars, trainer, lanes, end
        self.max_inflight, self.unrecorded = max_inflight, unrecorded

    @classmethod
    def of(cls, timeline: list[dict[str, Any]]) -> Pipeline:
        fate = _take_fates(timeline)
        rollouts = sorted((line for line in timeline if line["e"] == "rollout"), key=lambda line: (line["start"], line["end"]))
        free: list[int] = []  # lanes free now, lowest first
        busy: list[tuple[float, int]] = []  # (end, lane)
        bars = []
        for line in rollouts:
            while busy and busy[0][0] <= line["start"]:
                heapq.heappush(free, heapq.heappop(busy)[1])
            lane = heapq.heappop(free) if free else len(busy)
            heapq.heappush(busy, (line["end"], lane))
            outcome = "failed" if line["outcome"] == "failed" else fate.get(line["take"], "unfinished")
            bars.append((lane, line["start"], line["end"], outcome, line["outcome"]))
        trainer = []
        unrecorded = 0
        for line in timeline:
            if line["e"] == "step":
                trainer += [(part, *line[part]) for part in ("wait", "train", "sync")]
            elif line["e"] == "eval":
                trainer.append(("eval", *line["span"]))
            if line["e"] in ("step", "end"):  # the spans left out past logging.timeline_max_rollouts
                unrecorded += sum(n for key, n in (line.get("unrecorded") or {}).items() if key != "tokens")
        lanes = 1 + max((b[0] for b in bars), default=0)
        end = max([b[2] for b in bars] + [t[2] for t in trainer] + [0.0])
        start = next((line for line in timeline if line["e"] == "start"), {})
        return cls(bars, trainer, lanes, end, start.get("max_inflight", 0), unrecorded)

    def aggregated(self, window: tuple[float, float] | None) -> bool:
        """Whether `draw` shows rates and in-flight bands (more than BARS_MAX rollouts in the window) rather than bars."""
        lo, hi = window if window is not None else (0.0, self.end)
        return sum(1 for bar in self.bars if bar[2] >= lo and bar[1] <= hi) > BARS_MAX

    def draw(self, plt: Any, window: tuple[float, float] | None, title: str) -> Any:
        lo, hi = window if window is not None else (0.0, self.end)
        shown = [bar for bar in self.bars if bar[2] >= lo and bar[1] <= hi]
        if self.aggregated(window):
            fig, (gen, rates, train) = plt.subplots(3, 1, figsize=(12, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1]})
            self._bands(gen, shown, lo, hi)
            self._rates(rates, shown, lo, hi)
        else:
            height = min(9.0, 2.0 + 0.06 * self.lanes)
            fig, (gen, train) = plt.subplots(2, 1, figsize=(12, height), sharex=True,
                                            gridspec_kw={"height_ratios": [max(3, self.lanes // 8), 1]})
            self._bars(gen, shown)
        gen.set_title(title)
        if self.max_inflight:
            gen.axhline(self.max_inflight, color="black", lw=0.8, ls="--")
            gen.text(lo, self.max_inflight, " generation.max_inflight", va="bottom", fontsize=8)
        if self.unrecorded:
            gen.text(0.0, -0.02, f"{self.unrecorded} rollouts after the first {len(self.bars)} are not in timeline.jsonl "
                     "(logging.timeline_max_rollouts) and not drawn", transform=gen.transAxes, va="top", fontsize=8, color="#d62728")
        self._trainer(train, lo, hi)
        return fig

    def _bars(self, gen: Any, shown: list[tuple[int, float, float, str, str]]) -> None:
        for outcome in FATES:
            lanes: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for lane, start, end, fate, _ in shown:
                if fate == outcome:
                    lanes[lane].append((start, max(end - start, 1e-9)))
            for lane, spans in lanes.items():
                gen.broken_barh(spans, (lane, 0.8), facecolors=COLOURS[outcome], linewidth=0)
            gen.bar(0, 0, color=COLOURS[outcome], label=f"{outcome} ({sum(len(s) for s in lanes.values())})")
        gen.set(ylim=(0, max(self.lanes, self.max_inflight) + 1),
                ylabel="rollouts in progress\n(one lane each; a rollout waiting\nto retry holds no request slot)")
        gen.grid(False)
        gen.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="rollouts, by what\nbecame of the group")

    def _bands(self, gen: Any, shown: list[tuple[int, float, float, str, str]], lo: float, hi: float) -> None:
        """Rollouts in flight, on average over each of 2 * BINS bins, stacked by what became of their group.

        A mean over the bin (each rollout adds the part of the bin it was open for), not a sample at
        one instant: bursts shorter than a bin are neither lost nor drawn as spikes."""
        bins = 2 * BINS
        width = max(hi - lo, 1e-9) / bins
        edges = [lo + i * width for i in range(bins + 1)]
        below = [0.0] * bins
        for outcome in FATES:
            spans = [(max(b[1], lo), min(b[2], hi)) for b in shown if b[3] == outcome]
            if not spans:
                continue
            top = list(below)
            for start, end in spans:
                for i in range(int((start - lo) / width), min(int((end - lo) / width), bins - 1) + 1):
                    top[i] += max(0.0, min(end, edges[i + 1]) - max(start, edges[i])) / width
            gen.fill_between(edges, [*below, below[-1]], [*top, top[-1]], step="post", color=COLOURS[outcome], linewidth=0,
                             label=f"{outcome} ({len(spans)})")
            below = top
        gen.set(ylim=(0, max([*below, self.max_inflight, 1]) * 1.1),
                ylabel=f"rollouts in flight, mean\nper {width:.3g} s, stacked (a rollout\nwaiting to retry holds no slot)")
        gen.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="rollouts, by what\nbecame of the group")

    def _rates(self, ax: Any, shown: list[tuple[int, float, float, str, str]], lo: float, hi: float) -> None:
        """Rollouts started, and ended by outcome, per second in each of BINS bins; a series that stays 0 is left out."""
        width = max(hi - lo, 1e-9) / BINS
        counts: dict[str, list[int]] = {key: [0] * BINS for key in ("started", "finished", "failed", "cancelled")}
        for _, start, end, _, outcome in shown:
            for key, t in (("started", start), (outcome, end)):
                if lo <= t <= hi:
                    counts[key][min(int((t - lo) / width), BINS - 1)] += 1
        left = [lo + i * width for i in range(BINS)]
        styles = {"started": ("#1f5fbf", "-"), "finished": ("#2e9e4f", "-"), "failed": ("#d62728", "-"), "cancelled": ("#f0a020", "--")}
        idle = []
        for key, series in counts.items():
            if not any(series):
                idle.append(key)
                continue
            colour, style = styles[key]
            ax.step(left, [n / width for n in series], where="post", color=colour, ls=style, lw=1.2, label=f"{key} ({sum(series)})")
        ax.set(ylabel="rollouts per second")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title=f"per {width:.3g} s bin")
        if idle:
            ax.text(0.0, 1.02, f"left out, 0 throughout: {', '.join(idle)}", transform=ax.transAxes, fontsize=8, color="#555555")

    def _trainer(self, train: Any, lo: float, hi: float) -> None:
        for part, row in (("wait", 0), ("train", 0), ("sync", 1), ("eval", 2)):
            spans = [(s, max(e - s, 1e-9)) for p, s, e in self.trainer if p == part and e >= lo and s <= hi]
            if spans:
                train.broken_barh(spans, (row, 0.8), facecolors=COLOURS[part], linewidth=0)
            train.bar(0, 0, color=COLOURS[part], label={"wait": "waiting for a batch", "train": "training a step",
                                                        "sync": "weight sync", "eval": "evaluation"}[part])
        train.set(ylim=(0, 3), yticks=[0.4, 1.4, 2.4], yticklabels=["steps", "sync", "eval"], xlim=(lo, hi), xlabel="seconds since start")
        train.grid(False)
        train.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="trainer")


def _take_fates(timeline: list[dict[str, Any]]) -> dict[int, str]:
    """What became of each take: trained, stale (requeued or dropped as stale), dropped (another reason)."""
    fate: dict[int, str] = {}
    for line in timeline:
        if line["e"] == "take" and line["ending"] != "buffered":
            fate[line["take"]] = "stale" if line["ending"] in ("requeued", "stale") else "dropped"
        elif line["e"] == "buffered":
            fate[line["take"]] = "trained" if line["outcome"] == "trained" else "stale"
    return fate
