"""The chaos suite: thousands of small seeded scenarios on virtual time, each checked against every invariant.

Each scenario (tests/sim/scenarios.py) draws staleness, tolerances, latencies, transient and
non-retryable errors, outages, hangs and per-prompt exceptions from one seed. A failing seed
prints the one-line command that replays it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import pytest

from asyncgrpo.commands.simulate import Simulation, simulate
from asyncgrpo.config import Config, validate_config
from asyncgrpo.generation.scripted import ScriptedGenerator
from asyncgrpo.metric_names import WASTE_REASONS
from asyncgrpo.telemetry.timeline import Timeline
from asyncgrpo.training.stub import StubTrainer
from asyncgrpo.types import Completion, GenerationRequest, Group
from tests.sim.scenarios import is_fault_free, resume_scenario, scenario

BATCH = 100


def replay_command(seed: int, *, resume: bool = False) -> str:
    test = "::test_resume_chaos_scenarios_keep_every_invariant" if resume else ""
    return f".venv/bin/python -m pytest -q tests/sim/test_chaos.py{test} --chaos-seed={seed}"


@dataclass(frozen=True)
class Attempt:
    """One attempt of a resumable request (`rollout.on_stale: resume`): its context and the tokens it generated."""

    context: tuple[int, ...]
    resumed: int
    tokens: tuple[int, ...]
    finished: bool


class WatchedGenerator(ScriptedGenerator):
    """The scenario's scripted generator, noting the virtual time and the version of each request it completes, and
    (resumable requests) what each attempt was given and generated, finished or interrupted."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.simulate, seed=cfg.run.seed, max_new_tokens=cfg.generation.max_new_tokens)
        self.finished: list[tuple[float, int]] = []
        self.attempts: dict[str, list[Attempt]] = {}

    async def generate(self, request: GenerationRequest) -> Completion:
        try:
            completion = await super().generate(request)
        except asyncio.CancelledError:
            if request.sink is not None:
                self._note(request, tuple(request.sink.token_ids), finished=False)
            raise
        self.finished.append((asyncio.get_running_loop().time(), completion.generation_version))
        if request.sink is not None:
            self._note(request, completion.token_ids, finished=True)
        return completion

    def _note(self, request: GenerationRequest, tokens: tuple[int, ...], *, finished: bool) -> None:
        self.attempts.setdefault(request.request_id, []).append(Attempt(request.prompt_token_ids, request.resumed_tokens, tokens, finished))


class WatchedTrainer(StubTrainer):
    """The stub trainer, noting the virtual time each step starts: the instant its batch was taken."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.simulate.step_time_s, cfg.simulate.token_time_s)
        self.started: list[float] = []

    async def train_step(self, groups: list[Group]) -> dict[str, float]:
        self.started.append(asyncio.get_running_loop().time())
        return await super().train_step(groups)


def check_scenario(seed: int, *, resume: bool = False) -> Simulation:
    recipe = resume_scenario(seed) if resume else scenario(seed)
    assert recipe is not None, f"chaos scenario {seed} cannot resume"
    cfg = validate_config(recipe, source=f"chaos scenario {seed}" + (" (resume)" if resume else ""))
    try:
        generator, trainer = WatchedGenerator(cfg), WatchedTrainer(cfg)
        # The run's timeline, in memory, its rollouts counted (not drawn as spans): what check_books holds the books to.
        timeline = Timeline(None, server=generator.name, max_inflight=cfg.generation.max_inflight, group_size=cfg.rollout.group_size,
                            max_rollout_spans=0)
        sim = simulate(cfg, generator, trainer, observer=timeline)
        check_outcome(sim)
        check_books(sim, timeline)
        check_waste(sim.cfg, generator, trainer)
        check_token_bound(sim)
        if resume:
            check_seams(sim, generator)
    except BaseException as exc:
        raise AssertionError(f"chaos scenario {seed} broke an invariant: {exc!r}\n  replay: {replay_command(seed, resume=resume)}") from exc
    return sim


def check_outcome(sim: Simulation) -> None:
    """The invariants simulate() does not already check (it checks accounting, staleness and leftover tasks)."""
    cfg, result, collector = sim.cfg, sim.result, sim.collector
    acc = collector.accounting
    # No hang: every run ends with a result; a stall is impossible with these deadlines.
    assert result.outcome in ("completed", "failed"), f"outcome {result.outcome}: {result.diagnostic}"
    # Exactly-once: the buckets match the collector's live state.
    assert acc.in_flight == collector.in_flight_groups
    # Admission's running count of rollouts waiting for a slot is the sum it replaces (groups left in flight included).
    assert collector.undispatched_rollouts == sum(g.size - g.dispatched for g in collector._in_flight.values())
    assert acc.buffered == len(collector.batches.buffer) + len(collector.batches.in_training)
    assert collector.open_requests == 0, "requests still counted open after the pipeline ended"
    assert sim.generator.in_progress == 0, "a request kept running after its rollout ended"
    # No prompt is trained twice in the same epoch.
    taken = Counter((g.prompt.id, g.prompt.epoch) for g in sim.trainer.trained_groups)
    assert not [k for k, n in taken.items() if n > 1], "a prompt was trained twice in one epoch"
    counters = collector.counters
    # Episodes: every environment error is a failed rollout or a retry (a cancelled episode is neither), and an
    # episode that outlived its grace is counted (simulate() holds env/abandoned_total to the hosts' own count).
    if cfg.env is None:
        assert counters["env/errors_total"] == counters["env/abandoned_total"] == 0
    else:
        assert counters["env/errors_total"] <= counters["rollout/failed_total"] + counters["rollout/retries_total"]
        if cfg.simulate.env.ignore_cancel_prob == 0 and cfg.simulate.env.stop_s.high <= cfg.env.cancel_grace_s:
            assert counters["env/abandoned_total"] == 0
    check_tokens(sim)
    if cfg.rollout.on_stale == "wait":  # each group trains at the step it targets (or earlier, at the end of data): never stale
        assert counters["rollout/stale_groups_total"] == 0, counters
        assert all(g.target_step is not None and g.target_step >= r.step for r in sim.records for g in r.batch)
    if result.outcome == "completed":
        assert result.diagnostic is None
        if result.stop_reason == "max_steps":
            assert result.steps == cfg.train.max_steps
        else:
            # End of data: everything that was in flight finished and was trained (or dropped).
            assert acc.in_flight == 0
            assert acc.buffered == 0 or (cfg.data.drop_last and acc.buffered < cfg.rollout.groups_per_step)
    else:
        d = result.diagnostic
        assert d is not None and d.kind in {
            "generation_failures", "drop_fraction", "filtered_fraction", "misconfigured_backend", "reward_error", "no_steps", "weight_sync",
            "teacher_error",
        }
        if d.kind == "generation_failures":
            assert d.count == cfg.rollout.max_generation_failures + 1
            assert d.original is not None and d.traceback
    if cfg.algorithm == "distill":
        check_per_sample(sim)
    if is_fault_free(cfg):
        check_fault_free(sim)


def check_books(sim: Simulation, timeline: Timeline) -> None:
    """The books agree with each other (rollout/books.py): every ending reached the accounting, the counters, the ledger,
    the timeline (the observer), the failure policy and the token books, once."""
    books = sim.collector.books
    acc, counters = books.accounting, books.counters
    assert acc.balanced(), acc.to_json()
    takes = Counter(line["ending"] for line in timeline.lines if line["e"] == "take")
    buffered = Counter(line["outcome"] for line in timeline.lines if line["e"] == "buffered")
    timeline.close()  # its last line counts the rollouts by outcome (none when no rollout ended)
    rollouts = Counter(next((line["unrecorded"] for line in timeline.lines if line["e"] == "end"), {}))
    # The timeline saw every ended take end once, as the accounting says; a buffered group ends once more.
    assert sum(takes.values()) == acc.taken - acc.in_flight, (takes, acc.to_json())
    assert takes["requeued"] == acc.requeued and takes["buffered"] == acc.trained + acc.buffered + buffered["stale"], (takes, buffered, acc.to_json())
    assert buffered["trained"] == acc.trained, (buffered, acc.to_json())
    for reason, n in acc.dropped.items():
        assert takes[reason] + (buffered["stale"] if reason == "stale" else 0) == n, (reason, takes, buffered, acc.to_json())
    # The counters' drops, requeues and stale groups; the failed rollouts the timeline saw.
    assert counters["rollout/dropped_groups_total"] == sum(acc.dropped.values())
    for reason, n in acc.dropped.items():
        assert counters[f"rollout/dropped/{reason}"] == n, (reason, counters, acc.to_json())
    assert counters["rollout/requeued_total"] == acc.requeued
    assert counters["rollout/stale_groups_total"] == acc.requeued + acc.dropped["stale"], (counters, acc.to_json())
    assert rollouts["failed"] == counters["rollout/failed_total"], (rollouts, counters)
    if sim.cfg.env is None:  # an episode's completion holds the environment's tokens too
        assert rollouts["tokens"] == counters["rollout/generated_tokens_total"], (rollouts, counters)
    # The ledger (and its sink, outcomes.jsonl in a run) holds exactly the takes trained or dropped.
    assert sum(map(len, books.ledger.done_by_epoch().values())) == len(sim.outcomes) == acc.trained + sum(acc.dropped.values())
    ledgered = Counter(o.get("reason", o["outcome"]) for o in sim.outcomes)
    assert ledgered == Counter({"trained": acc.trained, **acc.dropped}) - Counter(), (ledgered, acc.to_json())
    # The failure policy judged every group that was buffered or dropped by its judge (stale is a cancellation).
    assert books.policy.judged == takes["buffered"] + sum(n for reason, n in takes.items() if reason in acc.dropped and reason != "stale")
    # The token books trained what the trainer trained.
    assert counters["rollout/trained_completions_total"] == sum(len(g.rollouts) for g in sim.trainer.trained_groups)
    assert counters["rollout/trained_tokens_total"] == sum(r.completion.model_tokens for g in sim.trainer.trained_groups for r in g.rollouts)


def check_waste(cfg: Config, generator: WatchedGenerator, trainer: WatchedTrainer) -> None:
    """Wasted generation is bounded: generation stops as soon as no remaining step can train it.

    Taking step s makes every rollout of version s - K stale for good (K = rollout.max_staleness); the
    collector then cancels them at once, so no request of that version may complete after step s started."""
    k = cfg.rollout.max_staleness
    for finished_at, version in generator.finished:
        step = version + k
        if step < len(trainer.started):
            assert finished_at <= trainer.started[step], (
                f"a request of version {version} completed at {finished_at:.3f} s (virtual), after step {step} had made it "
                f"stale at {trainer.started[step]:.3f} s: it was generated on instead of being cancelled"
            )


def check_per_sample(sim: Simulation) -> None:
    """Distillation: every unit is one sample, scored by the teacher; a stale unit is one stale sample."""
    counters = sim.collector.counters
    assert all(len(g.rollouts) == 1 and g.rollouts[0].teacher_logprobs is not None for g in sim.trainer.trained_groups)
    assert counters["rollout/stale_samples_total"] == counters["rollout/stale_groups_total"], counters
    assert counters["rollout/dropped/filtered"] == counters["rollout/dropped/too_few_survivors"] == 0, counters


def check_tokens(sim: Simulation) -> None:
    """Every generated token is trained, masked as older than the bound (`resume`), wasted for a reason, or still held (in
    flight, buffered, in training; a held group's masked tokens are counted masked)."""
    collector, counters = sim.collector, sim.collector.counters
    held = sum(g.finished_tokens() for g in collector._in_flight.values())
    held += sum(r.completion.model_tokens for g in collector.batches.buffer.groups() + collector.batches.in_training for r in g.rollouts)
    wasted = sum(counters[f"rollout/wasted_tokens/{reason}"] for reason in WASTE_REASONS)
    masked = counters["rollout/masked_stale_tokens_total"]
    assert counters["rollout/generated_tokens_total"] == counters["rollout/trained_tokens_total"] + masked + wasted + held, counters
    if sim.cfg.rollout.on_stale != "resume":
        assert masked == counters["rollout/resumed_rollouts_total"] == 0, counters
    assert counters["rollout/wasted_tokens/stale"] == counters["rollout/wasted_tokens_total"]
    assert counters["rollout/trained_generation_ms_total"] <= counters["rollout/generation_ms_total"]


def check_token_bound(sim: Simulation) -> None:
    """No token of a version older than step - K is in the loss of the step that trains it (masked tokens stay as context), nor
    one older than step - rollout.max_prefix_staleness in a rollout with a resumed prefix; a rollout whose tokens are all of
    one version, in whatever group, is held to K."""
    k, k_resumed = sim.cfg.rollout.max_staleness, sim.cfg.rollout.max_prefix_staleness
    for record in sim.records:
        for group in record.batch:
            assert group.max_staleness in (None, k_resumed), (group.max_staleness, k, k_resumed)
            for rollout in group.rollouts:
                c = rollout.completion
                spans = len(set(c.versions)) > 1
                bound = k_resumed if spans and k_resumed is not None else k
                trained = c.versions if c.loss_mask is None else [v for v, m in zip(c.versions, c.loss_mask) if m]
                assert min(trained, default=record.step) >= record.step - bound, (record.step, bound, c.versions, c.loss_mask)


def check_seams(sim: Simulation, generator: WatchedGenerator) -> None:
    """`resume`: a trained rollout's ids are exactly its attempts' tokens end to end, each resumed attempt given the prompt
    and every token before it as context: nothing lost or duplicated at a seam. An episode's are so turn by turn, each
    turn starting where the environment's tokens after the one before it end."""
    resumed = 0
    for group in sim.trainer.trained_groups:
        for rollout in group.rollouts:
            c = rollout.completion
            if c.episode is None:
                n = seams(c.token_ids, group.prompt.token_ids, 0, generator.attempts[c.text.rsplit(":", 1)[0]], len(c.token_ids))
            else:  # played by one of the group's members: the one whose turns' attempts join into it
                takes = [f"{group.prompt.id}-{group.prompt.epoch}-{group.prompt.requeues}-{m}" for m in range(sim.cfg.rollout.group_size)]
                n = next((n for n in (episode_seams(c, c.prompt_token_ids or group.prompt.token_ids, take, generator) for take in takes)
                          if n is not None), None)
            assert n is not None, (c, group.prompt)
            resumed += n
    assert resumed <= sim.collector.counters["rollout/resumed_rollouts_total"], resumed


def seams(ids: tuple[int, ...], prompt: tuple[int, ...], start: int, attempts: list[Attempt], end: int | None = None) -> int | None:
    """The resumptions of the request whose attempts are `attempts` and whose tokens are `ids[start:end]` (`end` None: the
    finished attempt's end, wherever it is) after the context `prompt + ids[:start]`; None when they do not join exactly."""
    finished, resumed = True, 0
    while True:  # from the finished attempt back to the first, each one's tokens right before the next one's
        piece = next((a for a in reversed(attempts) if a.finished == finished and (end is None or start + a.resumed + len(a.tokens) == end)
                      and (finished or a.tokens)  # an interruption that kept no token is no piece
                      and ids[start + a.resumed:start + a.resumed + len(a.tokens)] == a.tokens
                      and a.context == prompt + ids[:start + a.resumed]), None)
        if piece is None:
            return None
        if piece.resumed == 0:
            return resumed
        end, finished, resumed = start + piece.resumed, False, resumed + 1


def episode_seams(c: Completion, prompt: tuple[int, ...], take: str, generator: WatchedGenerator) -> int | None:
    """The resumptions of an episode played by the rollout whose request id is `take` (its turns' `take-t0`, `take-t1`, ...);
    None when its turns do not join exactly (another member's, or lost or duplicated tokens)."""
    assert c.episode is not None
    resumed, start = 0, 0
    for turn in range(c.episode.turns):
        attempts = generator.attempts.get(f"{take}-t{turn}", [])
        # The turn's first attempt: its context is the prompt and the episode's tokens up to the turn (environment's included).
        firsts = [len(a.context) - len(prompt) for a in attempts if not a.resumed and len(a.context) - len(prompt) >= start
                  and a.context == prompt + c.token_ids[:len(a.context) - len(prompt)]]
        n = seams(c.token_ids, prompt, firsts[-1], attempts) if firsts else None
        if n is None:
            return None
        start, resumed = firsts[-1], resumed + n
    return resumed


def check_fault_free(sim: Simulation) -> None:
    """Without faults a run completes, and nothing fails, retries or stalls: cancellation (stale groups,
    shutdown, end of data) and weight publications that take time are never failures."""
    result, counters, acc = sim.result, sim.collector.counters, sim.collector.accounting
    assert result.outcome == "completed" and result.diagnostic is None, f"a fault-free scenario ended {result.outcome}: {result.diagnostic}"
    assert counters["rollout/failed_total"] == counters["rollout/retries_total"] == 0, counters
    for reason in ("failed", "invalid_prompt", "too_few_survivors", "reward_error", "filtered"):
        assert acc.dropped[reason] == 0, acc.dropped


def seeds(config: pytest.Config) -> list[int]:
    chosen = config.getoption("--chaos-seed")
    if chosen is not None:
        return [chosen]
    return list(range(config.getoption("--chaos-scenarios")))


@pytest.fixture
def chaos_seeds(request: pytest.FixtureRequest) -> list[int]:
    return seeds(request.config)


# 2000 scenarios take about 60 s of CPU; on a loaded 2-core machine that is more than the suite's 120 s default,
# which is a hang guard, not a speed test: each scenario runs on virtual time and cannot hang on its own.
@pytest.mark.timeout(600)
def test_chaos_scenarios_keep_every_invariant(chaos_seeds: list[int]) -> None:
    outcomes: Counter[str] = Counter()
    fault_free = slow_publications = 0
    for seed in chaos_seeds:
        sim = check_scenario(seed)
        kind = sim.result.diagnostic.kind if sim.result.diagnostic else sim.result.stop_reason
        outcomes[f"{sim.result.outcome}:{kind}"] += 1
        fault_free += is_fault_free(sim.cfg)
        slow_publications += sim.cfg.simulate.weight_sync_s.dist != "const" or sim.cfg.simulate.weight_sync_s.value > 0
    if len(chaos_seeds) >= 500:
        # Enough fault-free runs to hold them to zero failures (about a fifth: environment and teacher
        # faults are drawn on top of request and publication faults), and publications that take time (the
        # wake-up after a publication is needed only when the new version arrives after the waiters slept).
        assert fault_free >= len(chaos_seeds) // 6 and slow_publications >= len(chaos_seeds) // 2, (fault_free, slow_publications)
        # The sweep must exercise the interesting paths, not only happy runs.
        for expected in ("completed:max_steps", "completed:data_exhausted", "failed:generation_failures", "failed:drop_fraction",
                         "failed:reward_error", "failed:misconfigured_backend", "failed:filtered_fraction", "failed:weight_sync",
                         "failed:teacher_error"):
            assert outcomes[expected] > 0, f"no scenario reached {expected}: {outcomes}"


# Two hundred of the scenarios again under `rollout.on_stale: resume` (scenarios.resume_scenario): the same checks, and
# the per-token bound and the seams of resumed rollouts and of resumed episodes' turns.
@pytest.mark.timeout(600)
def test_resume_chaos_scenarios_keep_every_invariant(request: pytest.FixtureRequest) -> None:
    chosen = request.config.getoption("--chaos-seed")
    count = min(200, request.config.getoption("--chaos-scenarios"))
    seeds = [chosen] if chosen is not None else [s for s in range(2 * count) if resume_scenario(s) is not None][:count]
    outcomes: Counter[str] = Counter()
    for seed in seeds:
        sim = check_scenario(seed, resume=True)
        outcomes[sim.result.outcome] += 1
        outcomes["resumed"] += sim.collector.counters["rollout/resumed_rollouts_total"] > 0
        outcomes["masked"] += sim.collector.counters["rollout/masked_stale_tokens_total"] > 0
        outcomes["episodes resumed"] += sim.cfg.env is not None and sim.collector.counters["rollout/resumed_rollouts_total"] > 0
    if len(seeds) >= 200:  # the sweep must resume (episodes too) and mask, not only run
        assert outcomes["resumed"] >= len(seeds) // 10 and outcomes["masked"] > 0 and outcomes["completed"] > 0, outcomes
        assert outcomes["episodes resumed"] > 0, outcomes


def test_a_group_dispatched_after_its_version_went_stale_is_cancelled_before_it_generates() -> None:
    # Scenario 364 (K = 0, over-admission): prompt 2's group is admitted at version 0 in the instant step 0 takes its
    # batch, and dispatched just after, at version 0, which no remaining step can train. It used to generate for a
    # whole latency and be thrown away at the end; now it ends as stale at dispatch (check_waste holds it to that).
    sim = check_scenario(364)
    assert sim.collector.counters["rollout/stale_groups_total"] == 1 and sim.collector.counters["rollout/wasted_tokens_total"] == 0
