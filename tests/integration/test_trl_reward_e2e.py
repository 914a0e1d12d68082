"""A TRL-style reward that schedules on the step and logs, in a real run (worker processes, the default isolation):
`trainer_state.global_step` is the steps completed when the group is scored (synchronous here, so the step that
trains it), `log_metric` values reach metrics.jsonl as `user/<name>` and `log_extra` columns reach samples.jsonl."""

from __future__ import annotations

import textwrap

import pytest

from asyncgrpo.cli import main
from asyncgrpo.telemetry.metrics import read_jsonl

pytestmark = pytest.mark.timeout(300)


def test_a_trl_reward_schedules_on_the_step_and_its_logs_reach_the_run_files(tmp_path):
    rewards = tmp_path / "stepwise.py"
    rewards.write_text(textwrap.dedent('''
        def by_step(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
            step = trainer_state.global_step
            log_metric("global_step", step)
            log_metric("progress", step / trainer_state.max_steps)
            log_extra("step_seen", [step] * len(completions))
            return [float(step) + 0.01 * len(c) for c in completions]
    '''))
    run = tmp_path / "run"
    code = main(["train", "recipes/demo.yaml", f"run.output_dir={run}", f"reward.functions=[{rewards}:by_step]", "train.max_steps=3",
                 "rollout.max_staleness=0", "rollout.groups_per_step=2", "rollout.group_size=2", "eval.every_steps=0",
                 "logging.progress=false", "logging.samples_per_step=4", "logging.sinks=[jsonl,tensorboard]"])
    assert code == 0
    lines = read_jsonl(run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["user/global_step"] for line in lines] == [0, 1, 2]
    assert [line["user/progress"] for line in lines] == pytest.approx([0, 1 / 3, 2 / 3])
    assert [int(line["reward/mean"]) for line in lines] == [0, 1, 2]  # the reward scheduled on the step
    samples = read_jsonl(run / "samples.jsonl")
    assert len(samples) == 12 and all(sample["extra"] == {"step_seen": sample["step"]} for sample in samples)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the trackers get the same line

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("user/global_step")] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_the_simulator_passes_the_step_and_writes_the_logged_metrics(tmp_path):
    rewards = tmp_path / "stepwise_sim.py"
    rewards.write_text(textwrap.dedent('''
        import random

        def by_step(prompts, completions, trainer_state, log_metric, **kwargs):
            log_metric("global_step", trainer_state.global_step)
            return [random.random() for _ in completions]
    '''))
    out = tmp_path / "sim"
    code = main(["simulate", "recipes/simulate.yaml", f"reward.functions=[{rewards}:by_step]", "train.max_steps=4",
                 "rollout.max_staleness=0", "simulate.faults=[]", "--output-dir", str(out)])
    assert code == 0
    assert [line["user/global_step"] for line in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
