"""timeline.jsonl records each episode's turns and environment calls (rollout/episode_events.py), on virtual time: their
durations are the simulator's models (each call simulate.env.call_s, each turn the token model's prefill and decode),
every written episode has its reset, a step per turn with the tokens its observation added to the episode and the
ending the environment gave, and beyond the span limit an
episode's lines are left out with its rollout's."""

from __future__ import annotations

from collections import defaultdict

import pytest

from asyncgrpo.commands.simulate import simulate
from asyncgrpo.config import load_config
from asyncgrpo.telemetry.metrics import read_jsonl

EPISODES = [
    "data.builtin_size=256", "generation.max_inflight=16", "generation.max_new_tokens=64", "rollout.group_size=4",
    "rollout.groups_per_step=2", "train.max_steps=6", "simulate.faults=[]", "simulate.token_time_s=0.001",
    "simulate.tokens={dist: lognormal, median: 20, sigma: 0.3}",
    "simulate.token_model={rollout_sigma: 0.2, prefill_s: 0.05, decode_s_per_token: 0.01, batch_knee: 64}",
    "env={factory: 'simulated:env', max_turns: 3, max_tokens: 4096}",
    "simulate.env={call_s: {dist: const, value: 0.25}, done_prob: 0.4}",
]


def episode_lines(tmp_path, *extra):
    simulate(load_config("recipes/simulate.yaml", [*EPISODES, *extra]), output_dir=tmp_path)
    lines = read_jsonl(tmp_path / "timeline.jsonl")
    by_rollout: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for line in lines:
        if line["e"] in ("turn", "env"):
            by_rollout[(line["take"], line["member"])].append(line)
    return lines, by_rollout


def test_each_turn_and_environment_call_is_written_with_its_duration(tmp_path):
    lines, by_rollout = episode_lines(tmp_path)
    finished = [r for r in lines if r["e"] == "rollout" and r["outcome"] == "finished"]
    assert finished and {(r["take"], r["member"]) for r in finished} <= set(by_rollout)
    endings = set()
    for r in finished:
        episode = by_rollout[(r["take"], r["member"])]
        calls = [c for c in episode if c["e"] == "env"]
        turns = [t for t in episode if t["e"] == "turn"]
        assert [c["call"] for c in calls] == ["reset"] + ["step"] * len(turns)
        assert all(c["end"] - c["start"] == pytest.approx(0.25, abs=2e-6) for c in calls)
        assert all(t["end"] - t["start"] == pytest.approx(0.05 + 0.01 * t["tokens"], abs=2e-6) for t in turns)
        assert all(r["start"] <= line["start"] <= line["end"] <= r["end"] for line in episode)
        *middle, last = calls[1:]
        assert not any(c["done"] for c in middle) and (last["done"] or len(turns) == 3)
        assert all(c["tokens"] == len("next") for c in middle) and "tokens" not in last  # text prompts: the observation alone
        endings.add(last["done"])
    assert endings == {True, False}  # episodes ended by the environment and at env.max_turns


def test_beyond_the_span_limit_an_episode_is_left_out_with_its_rollout(tmp_path):
    lines, by_rollout = episode_lines(tmp_path, "logging.timeline_max_rollouts=10")
    written = {(r["take"], r["member"]) for r in lines if r["e"] == "rollout"}
    assert len(written) == 10 and set(by_rollout) == written


def test_a_turn_that_the_episode_budget_cuts_records_its_limit(tmp_path):
    lines, by_rollout = episode_lines(tmp_path, "env.max_tokens=80")
    limits = []
    for r in (r for r in lines if r["e"] == "rollout" and r["outcome"] == "finished"):
        generated = 0  # model and environment tokens after the prompt, as env.max_tokens counts them
        for line in by_rollout[(r["take"], r["member"])]:
            if line["e"] == "turn":
                limits.append(line.get("limit"))
                assert line.get("limit") == (80 - generated if 80 - generated < 64 else None)
            generated += line.get("tokens", 0)  # a turn's, or a step's observation's
    assert None in limits and any(limits)
