"""wiring/: the one place a run is wired. A resumed run's parts continue the checkpoint's books from their
constructors on; a simulation whose parts fail to start leaves none of its report's files open."""

from __future__ import annotations

import gc
import warnings

import pytest

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.errors import ConfigError
from asyncgrpo.wiring.prompts import simulation_prompts
from asyncgrpo.wiring.run import Backends, wire_run
from tests.sim.fakes import ProgrammedGenerator, recipe

SAVED = {
    "done": {0: [0, 1, 2]},
    "accounting": {"taken": 7, "trained": 4, "requeued": 1, "dropped": {"failed": 1}, "in_flight": 1, "buffered": 0},
    "counters": {"rollout/generated_tokens_total": 120},
    "timeline": {"rollout_spans": 9, "elapsed_s": 30.0},
}


def test_a_resumed_run_continues_the_checkpoints_books():
    cfg = recipe()
    prompts, _ = simulation_prompts(cfg)
    written: list[dict] = []
    parts = wire_run(cfg, prompts, Backends(ProgrammedGenerator(), isolation="inline"), outcomes=written.append, start_step=2,
                     saved=SAVED)
    acc = parts.collector.accounting
    # what was in flight at the checkpoint is generated again: that take ended as requeued
    assert (acc.taken, acc.trained, acc.requeued, acc.dropped["failed"], acc.in_flight) == (7, 4, 2, 1, 0)
    assert parts.collector.counters["rollout/generated_tokens_total"] == 120
    assert parts.collector.next_step == 2
    assert parts.ledger.done_by_epoch() == {0: [0, 1, 2]}
    assert parts.collector.source.take().id == 3  # the source skips the prompts the checkpoint's ledger has done
    assert parts.timeline is None  # no file given: no timeline
    assert parts.reward_terms == ["coin"]
    assert parts.scorer.trainer_state().global_step == 2  # TRL's trainer_state follows the collector's steps


def test_a_simulation_whose_parts_fail_to_start_leaves_no_report_file_open(tmp_path):
    cfg = recipe(reward={"functions": ["builtin:no_such_reward"]})
    with pytest.raises(ConfigError, match="no_such_reward"):
        simulate(cfg, ProgrammedGenerator(), output_dir=tmp_path)
    assert (tmp_path / "metrics.jsonl").exists()  # the report's files were opened before the scorer failed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert not [w for w in caught if str(tmp_path) in str(w.message)], [str(w.message) for w in caught]
