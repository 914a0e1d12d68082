"""Fit the simulator's models to a run's records: pure functions over plain numbers, no I/O.

Job: each function takes what the timeline and metrics recorded and returns the parameters of one
model of the simulator (config/simulate.py, generation/scripted.py, training/stub.py); completion lengths,
those cut at their budget censored, are fitted in lengths.py:
- `fit_decode`: `prefill_s`, `decode_s_per_token` and `batch_knee` of the token model, from rollout
  spans (duration, tokens, and the rollouts open at each one's start, counted here);
- `fit_faults`: the injected faults that reproduce the run's retry, failure and invalid-prompt rates;
- `fit_trainer`: seconds per trained token and per step (the per-step line's intercept, when the steps show one);
- both, given when the other side was busy, fit the slowdown it caused (simulate.contention, tuning/contention.py);
- `fit_env`: the simulated environment (simulate.env) from an episode's environment calls: time per call (lognormal,
  of the mean and the variance within cohorts of the episode's time outside its turns, `env_times`), the chance a step ends the episode
  per step index (`done_probs`: of an episode's steps at that index, those the environment ended, so an episode cut at
  env.max_turns counts its steps without an ending; the indices from the first with fewer than MIN_STEPS_PER_INDEX steps
  on pool into the last entry, `done_per_index`) and over all steps (`done_prob`), the chance a step rewards 1.0 when
  every step's reward is 0 or 1 (what the simulated environment gives; else it is not fitted), and the environment
  tokens of an observation that joined its episode (they count in the trainer's time and in env.max_tokens);
- `fit_env_errors`: the simulated environment's error and transient-error rates per call, from env/errors_total and which
  failed rollouts failed in an environment call (their last episode line);
- `mean_or_zero`: weight-sync and evaluation time (per evaluation inside the training loop).

Invariants: every function is deterministic and returns finite, non-negative parameters the config
accepts (decode time > 0, knee >= 1); a model with nothing to fit from gets a neutral value (no spread,
no faults) rather than an error: records.py has already refused a run with too little to fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.tuning.contention import Overlap, busy_windows, fit_contended

MIN_DECODE_S_PER_TOKEN = 1e-9  # the config needs > 0


@dataclass(frozen=True)
class EnvFit:
    call_median_s: float  # of one reset or step (lognormal)
    call_sigma: float
    done_prob: float  # per step, every index pooled
    reward_prob: float | None  # per step, of reward 1.0; None: the steps' rewards are not all 0 or 1 (not what the simulator models)
    calls: int
    steps: int
    observation_tokens: float  # mean environment tokens of a step whose observation joined its episode (0: none did)
    observation_chars: int = 0  # simulate.env.observation_chars giving that many under the simulator's codec (calibrate.py)
    errors: EnvErrorFit | None = None  # the calls' errors (fit_env_errors); None: not fitted
    done_probs: tuple[float, ...] = ()  # per step index, the last pooling every later one (done_per_index); (): none fitted

    def simulate_env(self) -> dict[str, Any]:
        """The fitted simulate.env keys."""
        fitted: dict[str, Any] = {"call_s": {"dist": "lognormal", "median": round(self.call_median_s, 9), "sigma": round(self.call_sigma, 6)},
                                  "done_prob": round(self.done_prob, 6), "observation_chars": self.observation_chars}
        if self.done_probs:
            fitted["done_probs"] = [round(p, 6) for p in self.done_probs]
        if self.errors is not None:
            fitted.update(error_prob=round(self.errors.error_prob, 6), transient_prob=round(self.errors.transient_prob, 6))
        return fitted if self.reward_prob is None else {**fitted, "reward_prob": round(self.reward_prob, 6)}


@dataclass(frozen=True)
class EnvErrorFit:
    error_prob: float  # per call (reset or step attempted), an error that failed the rollout (simulate.env.error_prob)
    transient_prob: float  # per call, an error the episode was retried after (simulate.env.transient_prob)
    failed: int  # rollouts the environment failed, in the whole run
    retried: int  # environment errors retried, in the whole run (they are in rollout/retries_total too)


def fit_env_errors(rollouts: Iterable[dict[str, Any]], episode_lines: Iterable[dict[str, Any]], *, errors_total: int,
                   recorded_share: float) -> EnvErrorFit:
    """simulate.env's error rates from the run's env/errors_total and its timeline: the recorded rollouts ({take, member,
    outcome}) and their episodes' "turn" and "env" lines, `recorded_share` of the run's rollouts (logging.timeline_max_rollouts).

    An episode alternates environment calls and turns, and a line is written only for a call or a turn that returned; so a
    failed rollout whose last line is a turn, or that has none, failed in an environment call (a step or the reset raised, or
    outlived env.step_timeout_s), and one whose last line is an environment call failed generating (or on a reset observation
    too long for data.max_prompt_tokens, checked after its line). The environment errors
    that did not fail a rollout were retried (raised as transient), as far as env/errors_total tells: it also counts a close()
    that raised, which neither fails nor retries, and is taken for a retry here. The rates are per call attempted: the calls
    that returned (scaled from the recorded share to the run) and those that raised."""
    last: dict[tuple[int, int], tuple[float, str]] = {}
    calls = 0
    for line in episode_lines:
        key = (line["take"], line["member"])
        calls += line["e"] == "env"
        if key not in last or line["end"] >= last[key][0]:
            last[key] = (line["end"], line["e"])
    failed_recorded = sum(r["outcome"] == "failed" and last.get((r["take"], r["member"]), (0.0, "turn"))[1] == "turn" for r in rollouts)
    failed = min(errors_total, round(failed_recorded / recorded_share)) if recorded_share > 0 else 0
    retried = errors_total - failed
    attempted = calls / recorded_share + errors_total if recorded_share > 0 else errors_total
    if attempted <= 0:
        return EnvErrorFit(0.0, 0.0, 0, 0)
    return EnvErrorFit(failed / attempted, retried / attempted, failed, retried)


MIN_CALL_S = 1e-9  # a lognormal's median must be > 0; a call the clock saw take no time is this long


def env_times(rollouts: Iterable[dict[str, Any]], turns: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, seconds) of each finished episode's time that was not a turn's generation, one per environment call: before
    its first turn (the reset), between turns and after the last (the steps). Besides the calls themselves they hold what
    the simulator has no other model of (encoding observations, hops to the environment's thread), so they are the calls'
    time."""
    by_rollout: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for t in turns:
        by_rollout.setdefault((t["take"], t["member"]), []).append((t["start"], t["end"]))
    times = []
    for r in rollouts:
        spans = sorted(by_rollout.get((r["take"], r["member"]), []))
        if r["outcome"] != "finished" or not spans:
            continue
        edges = [r["start"], *(x for span in spans for x in span), r["end"]]
        times += [(edges[i], max(0.0, edges[i + 1] - edges[i])) for i in range(0, len(edges), 2)]
    return times


COHORT_S = 0.005  # calls that start this close together started on one event: the end of one wave of decoding
MIN_COHORT_DF = 30  # degrees of freedom the within-cohort variance needs to be used


def spread_within_cohorts(times: Sequence[tuple[float, float]]) -> float | None:
    """The variance of (start, seconds) around the mean of their cohort (the calls that started together), pooled; None with
    fewer than MIN_COHORT_DF degrees of freedom. Independent draws give the variance itself; an engine that decodes its
    requests in lock-step (the local engine) starts and slows its episodes' calls together, and what they share (a slow
    wave) then leaves the spread that delays a group's slowest episode, which an independent draw per call would overstate."""
    ordered = sorted(times)
    cohorts: list[list[float]] = []
    first = -math.inf
    for start, seconds in ordered:
        if start - first > COHORT_S:
            cohorts.append([])
            first = start
        cohorts[-1].append(seconds)
    df = sum(len(c) - 1 for c in cohorts)
    if df < MIN_COHORT_DF:
        return None
    return sum((x - statistics.fmean(c)) ** 2 for c in cohorts for x in c) / df


MIN_STEPS_PER_INDEX = 30  # steps an index needs for an entry of its own in done_probs; fewer pool into the last entry


def done_per_index(calls: Iterable[dict[str, Any]]) -> tuple[float, ...]:
    """Of "env" lines ({take, member, call, done}, each episode's in the order it made them), the share of the steps at each
    index (0: an episode's first step; a reset, a retried episode's, starts the count again) that ended the episode.
    Rule: the indices before the first with fewer than MIN_STEPS_PER_INDEX steps have an entry each, the last of them pooling
    every later index (its steps and theirs: the simulator repeats the last entry); when even index 0 is short, one entry
    pools them all; () with no step."""
    since_reset: dict[tuple[int, int], int] = {}
    counts: list[list[int]] = []  # per index: [steps, ended]
    for c in calls:
        key = (c["take"], c["member"])
        if c["call"] == "reset":
            since_reset[key] = 0
            continue
        index = since_reset.get(key, 0)
        since_reset[key] = index + 1
        counts += [[0, 0] for _ in range(index + 1 - len(counts))]
        counts[index][0] += 1
        counts[index][1] += bool(c.get("done"))
    own = next((i for i, (steps, _) in enumerate(counts) if steps < MIN_STEPS_PER_INDEX), len(counts))
    last = max(0, own - 1) if own < len(counts) else len(counts) - 1
    entries = counts[:last] + ([[sum(c[0] for c in counts[last:]), sum(c[1] for c in counts[last:])]] if counts else [])
    return tuple(ended / steps for steps, ended in entries)


def fit_env(calls: Sequence[dict[str, Any]], times: Sequence[tuple[float, float]] = ()) -> EnvFit:
    """simulate.env from "env" lines ({take, member, call, start, end, done, reward}, each episode's in order) and, for the
    time per call, `times` (env_times; without them, the calls' own spans): a lognormal of their mean and their variance
    within cohorts (spread_within_cohorts; all of it when too few calls started together). What a group waits for, its
    slowest episode, goes with both; a fit in logs would follow the many calls too short to matter. The chance a step ends
    its episode per step index: done_per_index."""
    if not calls:
        raise ValueError("no environment calls to fit the environment from")
    timed = list(times) or [(c["start"], c["end"] - c["start"]) for c in calls]
    durations = [seconds for _, seconds in timed]
    mean = max(MIN_CALL_S, statistics.fmean(durations))
    spread = spread_within_cohorts(timed)
    log_var = math.log1p((statistics.pvariance(durations) if spread is None else spread) / mean**2)
    steps = [c for c in calls if c["call"] == "step"]
    done = sum(bool(c.get("done")) for c in steps) / len(steps) if steps else 0.0
    rewards = [c.get("reward") for c in steps]
    binary = bool(steps) and all(r in (0.0, 1.0) for r in rewards)
    reward_prob = sum(r == 1.0 for r in rewards) / len(steps) if binary else None
    observed = [c["tokens"] for c in steps if "tokens" in c]
    return EnvFit(mean / math.exp(log_var / 2), math.sqrt(log_var), done, reward_prob, len(calls), len(steps),
                  statistics.fmean(observed) if observed else 0.0, done_probs=done_per_index(calls))


@dataclass(frozen=True)
class DecodeFit:
    prefill_s: float
    decode_s_per_token: float
    batch_knee: int
    rms_error_s: float  # of a rollout's duration under the fitted model
    max_concurrency: int  # most rollouts open at once in the records
    contention: float = 1.0  # decode's slowdown while the trainer trains (simulate.contention.decode; 1.0: none shown)
    contention_se: float | None = None


def concurrency_at_start(spans: Sequence[tuple[float, float]], order: Sequence[float] | None = None) -> list[int]:
    """For each (start, end) span, the spans open at its start, itself included (one ending at that instant is not).

    Spans starting at the same instant were dispatched in an order the records do not keep; they are counted
    in the order of `order` (smallest first; default: as given): fit_decode passes the time per token, since
    a server slows as it fills, so of requests sent together the first sent decodes fastest."""
    keys = order if order is not None else range(len(spans))
    events = sorted([(end, 0, 0.0, -1) for _, end in spans] + [(start, 1, float(keys[i]), i) for i, (start, _) in enumerate(spans)])
    open_now, result = 0, [0] * len(spans)
    for _, kind, _, index in events:
        if kind == 0:
            open_now -= 1
        else:
            open_now += 1
            result[index] = open_now
    return result


def fit_decode(spans: Sequence[dict[str, Any]], busy: Sequence[tuple[float, float]] = (),
               training: Sequence[tuple[float, float]] = ()) -> DecodeFit:
    """The token model's timing from rollout spans ({start, end, tokens, outcome}): duration = prefill_s +
    tokens * decode_s_per_token * max(1, n / batch_knee), n the rollouts open at the span's start.

    With `training` (the train spans, (start, end)), that is the span's work, done `contention` times slower
    while the trainer trained (tuning/contention.py), when the spans that overlapped training show a slowdown at
    the knee chosen without it (chosen with it, a knee can trade batch slowdown for contention in records
    where both rise together, and a few uncontended rollouts then show a slowdown the run never had).

    Every span counts towards n (a failed or cancelled rollout held a slot); only finished ones are fitted, and
    not those overlapping a `busy` (start, end) window: evaluations, whose requests the same servers decoded
    meanwhile (the simulator gives an evaluation its time apart, simulate.eval_s, not a slower decode).
    The knee is chosen among powers of two up to the most rollouts seen open (and that most itself: no
    slowdown observed), each with its least-squares (prefill, decode) line; the smallest squared error wins."""
    counts = concurrency_at_start([(s["start"], s["end"]) for s in spans],
                                  [(s["end"] - s["start"]) / s["tokens"] if s["tokens"] > 0 else math.inf for s in spans])
    kept = [(s, n) for s, n in zip(spans, counts)
            if s["outcome"] == "finished" and s["tokens"] > 0 and not any(s["start"] < end and start < s["end"] for start, end in busy)]
    if not kept:
        raise ValueError("no finished rollout spans outside evaluations to fit decode time from")
    trained = Overlap(busy_windows(training))
    rows = [(s["end"] - s["start"], s["tokens"], n) for s, n in kept]
    contended = [trained(s["start"], s["end"]) for s, _ in kept]
    most = max(counts)
    knees = sorted({2**i for i in range(most.bit_length()) if 2**i <= most} | {most})
    durations = [duration for duration, _, _ in rows]
    best: tuple[float, float, float, int] | None = None
    for knee in knees:
        xs = [tokens * max(1.0, n / knee) for _, tokens, n in rows]
        prefill, per_token = _line(xs, durations)
        sse = sum((duration - prefill - per_token * x) ** 2 for duration, x in zip(durations, xs))
        if best is None or sse < best[0] * (1 - 1e-9):
            best = (sse, prefill, per_token, knee)
    assert best is not None
    sse, prefill, per_token, knee = best
    xs = [tokens * max(1.0, n / knee) for _, tokens, n in rows]
    slowed = fit_contended([(1.0, x) for x in xs], durations, contended) if any(contended) else None
    if slowed is None or slowed.coefficients[1] <= 0:
        return DecodeFit(prefill, per_token, knee, math.sqrt(sse / len(rows)), most)
    prefill, per_token = slowed.coefficients
    return DecodeFit(prefill, per_token, knee, math.sqrt(slowed.sse / len(rows)), most, slowed.factor, slowed.factor_se)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x with a >= 0 and b > 0 (through the origin when the free intercept is negative)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a = my - b * mx
        if a >= 0 and b > 0:
            return a, b
    xx = sum(x * x for x in xs)
    b = sum(x * y for x, y in zip(xs, ys)) / xx if xx > 0 else 0.0
    return 0.0, max(b, MIN_DECODE_S_PER_TOKEN)


def fit_faults(*, finished: int, failed: int, cancelled: int, retries: int, takes: int, invalid_prompts: int) -> list[dict[str, Any]]:
    """Faults (simulate.faults) that reproduce the run's rates: a retried attempt as http_500, a rollout failed
    after its retries as http_400, an invalid prompt as prompt_too_long; each rate per attempt (per take for prompts)."""
    attempts = finished + failed + cancelled + retries
    faults = []
    if retries and attempts:
        faults.append({"error": "http_500", "rate": round(retries / attempts, 6)})
    if failed and attempts:
        faults.append({"error": "http_400", "rate": round(failed / attempts, 6)})
    if invalid_prompts and takes:
        faults.append({"error": "prompt_too_long", "rate": round(min(1.0, invalid_prompts / takes), 6)})
    return faults


@dataclass(frozen=True)
class TrainerFit:
    token_time_s: float  # seconds per trained token (simulate.token_time_s)
    overhead_s: float  # seconds per step besides its tokens (simulate.step_overhead_s): the line's intercept when the data shows one
    step_time_s: float  # mean seconds per step
    intercept_s: float  # of the free per-step line train_s = intercept + slope * tokens, and its standard error
    intercept_se_s: float | None  # None: fewer than 3 steps or all of one size, nothing to tell an intercept by
    slope_s: float
    contention: float = 1.0  # the trainer's slowdown while generation decodes (simulate.contention.train; 1.0: none shown)
    contention_se: float | None = None


def fit_trainer(steps: Sequence[tuple[float, int]], contended_s: Sequence[float] | None = None) -> TrainerFit:
    """Trainer time from (train seconds, trained tokens) per step; the first step (warm-up) is left out when more remain.

    With `contended_s` (per step, the seconds of its train span during which generation decoded), the time per token and
    overhead are those at full speed and `contention` the slowdown while generation decoded, when the steps show one
    (tuning/contention.py); else as below, over the steps' whole time.

    A step costs overhead + tokens x time per token. The overhead is the least-squares line's intercept when the steps
    show one: positive, with a positive slope, and more than INTERCEPT_SIGNIFICANCE standard errors from 0. Otherwise
    (steps of about equal size say nothing about it, or noise hides it) time is proportional to tokens, total over total.
    Either way the fit reproduces the run's total trainer time at its own step sizes (a line passes through the means)."""
    overlaps = list(contended_s) if contended_s is not None else [0.0] * len(steps)
    kept = [(s, t, c) for (s, t), c in zip(steps, overlaps) if t > 0]
    if len(kept) > 1:
        kept = kept[1:]
    if not kept:
        raise ValueError("no step trained any token")
    rows = [(s, t) for s, t, _ in kept]
    total_s, total_tokens = sum(s for s, _ in rows), sum(t for _, t in rows)
    xs, ys = [float(t) for _, t in rows], [s for s, _ in rows]
    intercept, slope = _line(xs, ys)
    se = _intercept_se(xs, ys, intercept, slope)
    overhead = intercept > 0 and se is not None and intercept > INTERCEPT_SIGNIFICANCE * se
    contended = [c for _, _, c in kept]
    slowed = fit_contended([(float(t), 1.0) if overhead else (float(t),) for t in xs], ys, contended) if any(contended) else None
    if slowed is not None and slowed.coefficients[0] > 0:
        per_token, *rest = slowed.coefficients
        return TrainerFit(per_token, rest[0] if rest else 0.0, total_s / len(rows), intercept, se, slope, slowed.factor, slowed.factor_se)
    if overhead:
        return TrainerFit(slope, intercept, total_s / len(rows), intercept, se, slope)
    return TrainerFit(total_s / total_tokens, 0.0, total_s / len(rows), intercept, se, slope)


INTERCEPT_SIGNIFICANCE = 3.0  # standard errors: an intercept nearer 0 than this is noise, not a per-step cost


def _intercept_se(xs: Sequence[float], ys: Sequence[float], intercept: float, slope: float) -> float | None:
    """Standard error of the line's intercept (None with fewer than 3 points or no spread in x: nothing to tell it by)."""
    n = len(xs)
    mx = statistics.fmean(xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or sxx <= 0:
        return None
    residual_var = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / (n - 2)
    return math.sqrt(residual_var * (1 / n + mx * mx / sxx))


def mean_or_zero(values: Iterable[float]) -> float:
    """The mean of `values`, 0.0 for none (a run without evaluations, a simulator-only sync)."""
    values = list(values)
    return statistics.fmean(values) if values else 0.0
