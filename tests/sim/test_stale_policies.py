"""The staleness policies end to end on virtual time (rollout/stale_policy.py): what each does with a straggler.

K = 1, one group of 2 per step, 1 s steps; prompts are taken in order 0, 1, 2, ... and every
request takes 1 s except the ones a test slows down.
"""

from __future__ import annotations

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.errors import GenerationError
from asyncgrpo.rollout.resume import rollout_bound
from tests.sim.fakes import OK, Fate, ProgrammedGenerator, member, recipe


def slow_prompt(prompt_id: int, after_s: float) -> ProgrammedGenerator:
    return ProgrammedGenerator(lambda r, a: Fate(after_s=after_s) if r.prompt_id == prompt_id else OK)


def run(on_stale: str, generator: ProgrammedGenerator, **rollout):
    cfg = recipe(rollout={"on_stale": on_stale, **rollout}, train={"max_steps": 5})
    sim = simulate(cfg, generator)
    assert sim.result.outcome == "completed" and sim.result.steps == 5
    return sim, [g.prompt.id for g in sim.trainer.trained_groups]


def test_requeue_cancels_the_straggler_and_trains_the_fast_prompts():
    sim, trained = run("requeue", slow_prompt(1, 6.0))
    assert trained[:3] == [0, 2, 3] and sim.collector.counters["rollout/stale_groups_total"] >= 1


def test_wait_trains_each_step_its_own_groups_and_never_cancels():
    sim, trained = run("wait", slow_prompt(1, 6.0))
    assert trained == [0, 1, 2, 3, 4]
    assert [g.target_step for r in sim.records for g in r.batch] == [0, 1, 2, 3, 4]
    assert sim.collector.counters["rollout/stale_groups_total"] == 0 and sim.collector.counters["rollout/requeued_total"] == 0
    assert sim.records[1].wait_s >= 3.0  # step 1 waited for its slow group
    assert sim.report()["wasted_tokens"] == {"stale": 0, "failed": 0, "filtered": 0}


def test_wait_replaces_a_dropped_group_in_the_same_step():
    failing = ProgrammedGenerator(lambda r, a: Fate(after_s=0.5, error=GenerationError("400", backend="programmed")) if r.prompt_id == 1 else OK)
    sim, trained = run("wait", failing, max_generation_failures=1)
    assert trained == [0, 2, 3, 4, 5]
    assert [g.target_step for r in sim.records for g in r.batch] == [0, 1, 2, 3, 4]


def test_patience_waits_for_a_straggler_within_its_share_of_a_step():
    # Prompt 1 (version 0) is due at t=3.4; step 1's batch (prompt 2, version 1) is ready at t=3, and the
    # next step would cancel prompt 1. Half a step (0.5 s) of patience covers it: it is trained at step 1.
    sim, trained = run("patience", slow_prompt(1, 3.4), patience_share=0.5)
    assert trained == [0, 1, 2, 3, 4] and sim.collector.counters["rollout/stale_groups_total"] == 0
    assert 1.39 < sim.records[1].wait_s < 1.41  # from t=2 to the straggler at t=3.4, not to the end of its patience


def test_patience_gives_up_on_a_straggler_past_its_share():
    sim, trained = run("patience", slow_prompt(1, 3.7), patience_share=0.5)
    assert trained[:2] == [0, 2] and sim.collector.counters["rollout/stale_groups_total"] >= 1


def test_partial_groups_train_a_stragglers_finished_members_and_cancel_the_rest():
    # Groups of 4: prompt 1's members 2 and 3 take 6 s. When step 1's batch is ready (t=3) prompt 1 is a
    # straggler with 2 finished members: it ends with them and is trained at step 1 (oldest first).
    slow_half = ProgrammedGenerator(lambda r, a: Fate(after_s=6.0) if r.prompt_id == 1 and member(r) >= 2 else OK)
    cfg = recipe(rollout={"on_stale": "requeue", "partial_groups": True, "group_size": 4}, train={"max_steps": 5})
    sim = simulate(cfg, slow_half)
    assert sim.result.outcome == "completed"
    trained = sim.trainer.trained_groups
    assert [g.prompt.id for g in trained] == [0, 1, 2, 3, 4]
    assert len(trained[1].rollouts) == 2 and trained[1].failed_rollouts == 0  # cut members are cancelled, not failed
    assert {"1-0-0-2", "1-0-0-3"} <= set(sim.generator.aborted)
    counters = sim.collector.counters
    assert counters["rollout/failed_total"] == counters["rollout/stale_groups_total"] == 0


def test_metrics_jsonl_carries_the_token_books(tmp_path):
    # What a real run can see of the bias (trained vs stale lengths) and its goodput, per step in metrics.jsonl.
    from asyncgrpo.config import load_config
    from asyncgrpo.telemetry.metrics import read_jsonl

    cfg = load_config("recipes/simulate_nemo.yaml", ["train.max_steps=30", "rollout.on_stale=requeue"])
    sim = simulate(cfg, output_dir=tmp_path)
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    report = sim.report()
    assert last["rollout/trained_tokens_total"] == report["trained_tokens"] > 0
    assert abs(last["rollout/trained_len_mean"] - report["trained_len_mean"]) < 1e-6
    assert last["rollout/trained_len_mean"] < last["rollout/stale_len_mean"]  # the short ones were trained
    assert 0 < last["rollout/goodput"] < 1  # (the report's also counts the rollouts cancelled at the end)
    assert report["length_bias"] < 0.95 and report["wasted_tokens"]["stale"] == last["rollout/wasted_tokens/stale"] > 0


def long_rollouts(generator=None, **rollout):
    """K = 1, groups of 2, one group per step of 1 s; a prompt's rollouts are 2 to 60 tokens at 0.1 s each: the long ones
    span several versions while the short ones keep the steps going."""
    cfg = recipe(rollout={"on_stale": "resume", "max_masked_share": 1.0, "max_resumptions": 8, **rollout}, train={"max_steps": 8},
                 generation={"max_new_tokens": 64, "max_inflight": 8},
                 simulate={"tokens": {"dist": "uniform", "low": 2, "high": 60},
                           "token_model": {"decode_s_per_token": 0.1, "rollout_sigma": 0.0}})
    return simulate(cfg, generator(cfg) if generator else None)


def test_resume_continues_a_long_rollout_under_each_new_version_and_masks_its_tokens_past_the_bound():
    sim = long_rollouts()
    assert sim.result.outcome == "completed" and sim.result.steps == 8
    counters = sim.collector.counters
    assert counters["rollout/stale_groups_total"] == 0 and counters["rollout/resumed_rollouts_total"] > 0
    assert counters["rollout/masked_stale_tokens_total"] > 0
    spanning = 0
    for record in sim.records:
        for group in record.batch:
            for rollout in group.rollouts:
                c = rollout.completion
                assert len(c.token_ids) == sim.generator.drawn_lengths[group.prompt.id][0]  # every token kept, none twice
                assert list(c.versions) == sorted(c.versions)
                spanning += len(set(c.versions)) > 1  # continued under newer weights
                mask = c.loss_mask or (True,) * len(c.versions)
                assert mask == tuple(v >= record.step - 1 for v in c.versions)  # exactly the tokens past K = 1 masked
    assert spanning >= 2
    assert sim.collector.metric_values()["rollout/trained_version_span"] >= 1


def test_resume_trains_a_resumed_groups_tokens_up_to_max_prefix_staleness():
    # K = 1 for fresh groups; a resumed group's tokens up to 3 steps old stay in the loss (importance-weighted), older are masked.
    plain, wide = long_rollouts(), long_rollouts(max_prefix_staleness=3)
    assert wide.result.outcome == "completed"
    masked = [sim.collector.counters["rollout/masked_stale_tokens_total"] for sim in (plain, wide)]
    assert masked[1] < masked[0]
    oldest = 0
    for record in wide.records:
        for group in record.batch:
            for rollout in group.rollouts:
                c = rollout.completion
                mask = c.loss_mask or (True,) * len(c.versions)
                assert mask == tuple(v >= record.step - rollout_bound(c, bound=1, prefix_bound=3) for v in c.versions)
                oldest = max(oldest, max(record.step - v for v, m in zip(c.versions, mask) if m))
    assert oldest > 1  # tokens past K trained, under the resumed groups' own bound of 3


def test_resume_cancels_a_group_whose_rollouts_would_be_resumed_too_often():
    # No resumption allowed: a long rollout is left behind as `requeue` (here: drop) leaves it, and nothing is masked.
    sim = long_rollouts(max_resumptions=0, max_requeues=0)
    counters = sim.collector.counters
    assert counters["rollout/stale_groups_total"] > 0 and counters["rollout/dropped/stale"] == counters["rollout/stale_groups_total"]
    assert counters["rollout/resumed_rollouts_total"] == counters["rollout/masked_stale_tokens_total"] == 0


def test_rollouts_in_flight_at_a_checkpoint_are_generated_again_after_it():
    # The checkpoint keeps the ledger, not the prefixes: a resumed run takes again every prompt not trained or dropped.
    from asyncgrpo.wiring.prompts import simulation_prompts
    from asyncgrpo.wiring.run import Backends, wire_run

    sim = long_rollouts()
    books = sim.collector.books
    done = books.ledger.done_by_epoch()
    in_flight = {g.prompt.id for g in sim.collector._in_flight.values()} | {g.prompt.id for g in sim.collector.batches.buffer.groups()}
    assert in_flight and not in_flight & set(done.get(0, []))
    saved = {"done": done, "accounting": books.accounting.to_json(), "counters": books.counters}
    prompts, _ = simulation_prompts(sim.cfg)
    parts = wire_run(sim.cfg, prompts, Backends(sim.generator, isolation="inline"), outcomes=lambda _: None, start_step=8, saved=saved)
    taken = [parts.collector.source.take().id for _ in range(len(in_flight))]
    assert set(taken) == in_flight  # the prompts whose rollouts were in flight come first, none that was trained


def test_resume_interrupts_nothing_on_a_backend_that_continues_in_flight():
    # The local engine installs weights between decoding steps (continues_in_flight): a rollout continues in place, so
    # resume interrupts none; its tokens past the bound are still masked (here all of a rollout carry its dispatch version,
    # so a rollout is masked whole, and a group whose every rollout is, is stale: its tokens wasted, not also masked).
    from asyncgrpo.generation.scripted import ScriptedGenerator
    from tests.sim.test_chaos import check_tokens

    class InPlace(ScriptedGenerator):
        continues_in_flight = True

    sim = long_rollouts(lambda cfg: InPlace(cfg.simulate, seed=cfg.run.seed, max_new_tokens=cfg.generation.max_new_tokens))
    assert sim.result.outcome == "completed"
    counters = sim.collector.counters
    assert counters["rollout/resumed_rollouts_total"] == 0 and counters["rollout/stale_groups_total"] > 0
    check_tokens(sim)  # generated = trained + masked + wasted + held
    for record in sim.records:
        for group in record.batch:
            for rollout in group.rollouts:
                c = rollout.completion
                assert len(set(c.versions)) == 1  # one attempt each: never interrupted and continued
                assert c.loss_mask is None or c.loss_mask == tuple(v >= record.step - 1 for v in c.versions)
