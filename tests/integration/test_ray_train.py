"""`asyncgrpo train ... runtime=ray` as a real process, on a local Ray cluster it starts itself (2 CPUs,
2 generator actors): a short run completes; a generator actor SIGKILLed mid-run is recovered while the
run goes on, and SIGTERM stops the run as in the local runtime; a Ctrl-C to the driver's process group
stops it as in the local runtime too; a driver SIGKILLed mid-run leaves its cluster to the run's reaper.
After each, no process of the run's Ray cluster is left (the reaper's included). The tests follow the
run through its stderr lines (no sleeping).
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.ray_cluster import left_after, processes_of
from tests.integration.train_process import read_until, records, start_train

RAY = ("runtime=ray", "ray.generators=2", "ray.num_cpus=2", "ray.generator.num_cpus=1")
SMALL = ("rollout.groups_per_step=3", "rollout.group_size=4", "eval.every_steps=0", "checkpoint.every_steps=0")


def generator_actors(temp_dir: str) -> list[int]:
    return sorted(pid for pid, cmdline in processes_of(temp_dir).items() if cmdline.startswith("ray::GeneratorActor"))


@pytest.mark.timeout(300)
def test_a_short_ray_run_with_two_generator_actors_completes(tmp_path, ray_tmpdir):
    with start_train(tmp_path, *RAY, *SMALL, "train.max_steps=4", env={"RAY_TMPDIR": ray_tmpdir}) as proc:
        rest = proc.stderr.read()
        assert proc.wait(timeout=240) == 0, rest
    assert "completed 4 steps" in rest
    metrics = records(tmp_path, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and all(m["rollout/failed_total"] == 0 for m in metrics)
    assert "Traceback" not in rest


@pytest.mark.timeout(400)
def test_a_killed_generator_actor_is_recovered_mid_run_and_sigterm_then_stops_the_run_cleanly(tmp_path, ray_tmpdir):
    """SIGKILL one actor's process: the run goes on, the actor restarts and is given the current weights;
    then SIGTERM stops the run as in the local runtime (exit 143, checkpoint), with no Ray process left."""
    with start_train(tmp_path, *RAY, *SMALL, "train.max_steps=400", "rollout.max_generation_failures=2", "run.shutdown_timeout_s=60",
                     env={"RAY_TMPDIR": ray_tmpdir}) as proc:
        if not read_until(proc, "step "):
            pytest.fail(f"the run ended before training started (exit {proc.wait()}): {proc.stderr.read()}")
        actors = generator_actors(ray_tmpdir)
        assert len(actors) == 2, processes_of(ray_tmpdir)
        os.kill(actors[0], signal.SIGKILL)
        lost = next((line for line in proc.stderr if line.startswith("warning: generator actor ray-")), None)
        if lost is None or " lost (" not in lost:
            pytest.fail(f"the run did not report the kill before it ended (exit {proc.wait()}): {lost}")
        name = lost.split()[3]
        if not read_until(proc, f"warning: generator actor {name} recovered at version"):
            pytest.fail(f"the run ended before the actor was recovered (exit {proc.wait()})")
        assert read_until(proc, "step "), "the run did not train on after the recovery"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 143, rest
    assert "interrupted by SIGTERM" in rest and "Traceback" not in rest
    steps = len(records(tmp_path, "metrics.jsonl"))
    assert steps < 400
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == f"step_{steps:06d}"


@pytest.mark.timeout(300)
def test_a_ctrl_c_to_the_drivers_process_group_stops_the_run_cleanly(tmp_path, ray_tmpdir):
    """A terminal's Ctrl-C reaches the driver's whole process group (the cluster's head processes are in it): the run
    stops as in the local runtime (exit 130, checkpoint), and no process of its cluster is left (fixture)."""
    with start_train(tmp_path, *RAY, *SMALL, "train.max_steps=400", "run.shutdown_timeout_s=60", env={"RAY_TMPDIR": ray_tmpdir},
                     new_session=True) as proc:
        if not read_until(proc, "step "):
            pytest.fail(f"the run ended before training started (exit {proc.wait()}): {proc.stderr.read()}")
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, rest
    assert "interrupted by SIGINT" in rest and "Traceback" not in rest
    steps = len(records(tmp_path, "metrics.jsonl"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == f"step_{steps:06d}"


@pytest.mark.timeout(300)
def test_a_driver_killed_mid_run_leaves_no_ray_process_behind(tmp_path, ray_tmpdir):
    """SIGKILL the driver while it trains: it cannot clean up, Ray's head processes die with it (PR_SET_PDEATHSIG),
    and the run's reaper stops what the raylet started (its agents, the actors), then exits itself."""
    with start_train(tmp_path, *RAY, *SMALL, "train.max_steps=400", env={"RAY_TMPDIR": ray_tmpdir}) as proc:
        if not read_until(proc, "step "):
            pytest.fail(f"the run ended before training started (exit {proc.wait()}): {proc.stderr.read()}")
        assert len(generator_actors(ray_tmpdir)) == 2, processes_of(ray_tmpdir)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        proc.stderr.read()
    assert records(tmp_path, "metrics.jsonl")  # it was training
    left = left_after(ray_tmpdir)
    assert not left, f"Ray processes of the killed driver's cluster left: {left}"
