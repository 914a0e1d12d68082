"""Random small pipeline scenarios for the chaos suite, each fully determined by one integer seed.

`scenario(seed)` returns a recipe dict: at most 6 steps, at most 4 groups of at most 4 per
step, random latencies and lengths (or the token model: lengths per prompt, latency from
tokens), transient errors, non-retryable errors, outages, hangs, per-prompt exceptions,
staleness 0-4 under every staleness policy (`resume_scenario`: the same under `resume`), random tolerances, weight publications
that take virtual time and may fail or hang, (drawn after those) multi-turn episodes on the
simulator's environments, which take time, may raise, and may ignore their cancellation, and (a quarter
of the others) `algorithm: distill`: one sample per unit, scored by a simulated teacher that takes time,
fails and times out.

A scenario is *fault-free* (`is_fault_free`) when it injects no request fault, no
weight-publication fault, no environment error, no teacher fault or timeout, and uses the well-behaved reward (an
episode that ignores its cancellation is not a fault: it is abandoned and counted, never a failure); the generator then also keeps
its data and filter settings such that it must complete (at least one full step of data,
no zero-variance filtering), so the suite can require zero failures and zero stalls of it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from asyncgrpo.config import Config
from asyncgrpo.tasks import coin_reward

FAULT_KINDS = ("http_500", "http_429", "connection_refused", "http_400", "prompt_too_long", "hang", "exception", "http_404")


def scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    group_size = rng.randint(2, 4)
    max_staleness = rng.randint(0, 4)
    faults: list[dict[str, Any]] = []
    for _ in range(rng.choice((0, 0, 1, 2, 3))):
        kind = rng.choice(FAULT_KINDS)
        fault: dict[str, Any] = {"error": kind, "rate": rng.choice((0.05, 0.2, 0.5, 1.0))}
        if kind == "http_404":  # misconfiguration is fatal at once: keep it rare so other paths run too
            fault["rate"] = 0.02
        if rng.random() < 0.4:
            start = rng.uniform(0, 20)
            fault.update(from_s=round(start, 3), until_s=round(start + rng.uniform(1, 30), 3))
        if kind == "exception" or rng.random() < 0.15:
            fault["prompts"] = rng.sample(range(40), rng.randint(1, 4))
        faults.append(fault)
    latency = rng.choice(
        (
            {"dist": "const", "value": round(rng.uniform(0.1, 3), 3)},
            {"dist": "uniform", "low": 0.05, "high": round(rng.uniform(0.1, 4.5), 3)},
            {"dist": "lognormal", "median": round(rng.uniform(0.2, 2), 3), "sigma": round(rng.uniform(0, 1.2), 3), "max": 4.5},
        )
    )
    recipe = {
        "run": {"name": f"chaos-{seed}", "seed": seed},
        "data": {
            "source": "builtin:repeat_letter",
            "builtin_size": rng.randint(1, 40),
            "num_epochs": rng.randint(1, 2),
            "drop_last": rng.random() < 0.3,
        },
        "reward": {
            "functions": ["tests.sim.scenarios:flaky_reward" if rng.random() < 0.3 else "builtin:coin"],
            "on_error": rng.choice(("fail", "drop")),
        },
        "generation": {
            "backend": "scripted",
            "max_new_tokens": 64,
            "max_inflight": rng.randint(1, 16),
            "request_timeout_s": 5.0,
            "rollout_deadline_s": round(rng.uniform(5, 25), 3),
            "retry_backoff_s": 0.2,
            "retry_backoff_max_s": 2.0,
            "weight_sync_every": rng.randint(1, max_staleness + 1),
        },
        "rollout": {
            "group_size": group_size,
            "groups_per_step": rng.randint(1, 4),
            "max_staleness": max_staleness,
            "on_stale": rng.choice(("requeue", "drop")),
            "max_requeues": rng.randint(0, 2),
            "min_group_survivors": rng.randint(2, group_size),
            "max_generation_failures": rng.randint(0, 4),
            "drop_window": rng.randint(2, 16),
            "max_drop_fraction": rng.choice((0.3, 0.5, 1.0)),
            "max_filtered_fraction": rng.choice((0.5, 1.0)),
            "filter_zero_variance": rng.random() < 0.3,
            "stall_timeout_s": 120.0,
        },
        "simulate": {
            "latency_s": latency,
            "tokens": {"dist": "uniform", "low": 1, "high": 64},
            "faults": faults,
            "step_time_s": round(rng.uniform(0.1, 4), 3),
        },
        "train": {"backend": "stub", "max_steps": rng.randint(1, 6)},
    }
    # Drawn after the rest, so that adding them left every earlier draw of a seed as it was.
    generation, scripted = recipe["generation"], recipe["simulate"]
    scripted["weight_sync_s"] = rng.choice(
        (
            {"dist": "const", "value": 0.0},
            {"dist": "const", "value": round(rng.uniform(0.05, 3), 3)},
            {"dist": "uniform", "low": 0.0, "high": round(rng.uniform(0.1, 4.5), 3)},
            {"dist": "lognormal", "median": round(rng.uniform(0.1, 1.5), 3), "sigma": round(rng.uniform(0, 1.2), 3), "max": 4.5},
        )
    )
    generation["weight_sync_timeout_s"] = round(rng.uniform(10, 40), 3)
    if rng.random() < 0.1:
        fault = {"error": rng.choice(("fail", "hang")), "rate": rng.choice((0.1, 0.3, 1.0))}
        if rng.random() < 0.5:
            start = rng.uniform(0, 20)
            fault.update(from_s=round(start, 3), until_s=round(start + rng.uniform(1, 30), 3))
        scripted["weight_sync_faults"] = [fault]
    if rng.random() < 0.5:  # the staleness policies that wait (rollout/stale_policy.py)
        recipe["rollout"]["on_stale"] = rng.choice(("wait", "patience"))
        recipe["rollout"]["patience_share"] = rng.choice((0.0, 0.5, 2.0))
    if recipe["rollout"]["on_stale"] != "wait" and rng.random() < 0.2:
        recipe["rollout"]["over_admit_groups"] = rng.randint(1, 3)
    if recipe["rollout"]["on_stale"] != "wait" and rng.random() < 0.3:
        recipe["rollout"]["partial_groups"] = True  # ending early needs groups larger than their survivors
        recipe["rollout"]["group_size"] = max(3, recipe["rollout"]["group_size"])
        recipe["rollout"]["min_group_survivors"] = 2
    if rng.random() < 0.3:  # the token model (at most 64 tokens x 10 ms x 16 / 4 + 50 ms: under request_timeout_s)
        scripted["token_model"] = {"rollout_sigma": rng.choice((0.0, 0.5)), "prefill_s": rng.choice((0.0, 0.05)),
                                   "decode_s_per_token": rng.choice((0.002, 0.01)), "batch_knee": rng.randint(4, 16)}
        scripted["tokens"] = {"dist": "lognormal", "median": rng.randint(4, 32), "sigma": rng.choice((0.3, 1.0)), "max": 64}
        if rng.random() < 0.5:
            scripted["token_time_s"] = rng.choice((0.001, 0.01))
    if rng.random() < 0.3:
        # Multi-turn episodes on the simulator's environments: latency, errors, episodes that ignore cancellation.
        recipe["env"] = {
            "factory": "simulated:env",  # not imported by the simulator
            "max_turns": rng.randint(1, 4),
            "max_tokens": rng.choice((32, 128, 512)),
            "cancel_grace_s": rng.choice((0.05, 0.5, 2.0)),
            "reward_weight": rng.choice((0.0, 1.0)),
        }
        env_faults = rng.random() < 0.25
        scripted["env"] = {
            "call_s": {"dist": "uniform", "low": 0.0, "high": round(rng.uniform(0.01, 2.0), 3)},
            "done_prob": rng.choice((0.0, 0.3, 1.0)),
            "error_prob": rng.choice((0.05, 0.3)) if env_faults else 0.0,
            "transient_prob": rng.choice((0.0, 0.2)) if env_faults else 0.0,
            "ignore_cancel_prob": rng.choice((0.0, 0.3, 1.0)),
            "stop_s": {"dist": "uniform", "low": 0.0, "high": round(rng.uniform(0.01, 3.0), 3)},
        }
    if rng.random() < 0.25 and "env" not in recipe and not recipe["rollout"].get("partial_groups"):
        # (distillation plays no episodes, the config refuses both; its units of 1 cannot end early)
        # algorithm: distill: each sample its own unit, a simulated teacher with latency, faults and timeouts.
        recipe["algorithm"] = "distill"
        recipe["rollout"].update(group_size=1, min_group_survivors=1, filter_zero_variance=False)
        scripted["teacher_latency_s"] = {"dist": "uniform", "low": 0.01, "high": round(rng.uniform(0.02, 3), 3)}
        scripted["teacher_error_rate"] = rng.choice((0.0, 0.0, 0.0, 0.05, 0.3))
        recipe["distill"] = {"timeout_s": rng.choice((2.0, 30.0, 30.0)), "on_error": rng.choice(("fail", "drop"))}
    if recipe.get("algorithm") == "distill" and recipe["rollout"]["on_stale"] != "wait" and rng.random() < 0.5:
        # Over-admitted samples race for the steps within the bound and the slowest go stale in flight: the cancellation
        # that bounds wasted generation (test_chaos.check_waste) must reach distilled samples too.
        recipe["rollout"]["over_admit_groups"] = rng.randint(1, 4)
        recipe["rollout"]["max_staleness"] = rng.randint(0, 1)
        generation["weight_sync_every"] = 1
    if not faults and "weight_sync_faults" not in scripted and recipe["reward"]["functions"] == ["builtin:coin"] and not env_errors(recipe):
        # Fault-free: nothing may stop it but its own max_steps or end of data.
        recipe["rollout"]["filter_zero_variance"] = False
        data = recipe["data"]
        if data["builtin_size"] * data["num_epochs"] < recipe["rollout"]["groups_per_step"]:
            data["drop_last"] = False
    return recipe


def env_errors(recipe: dict[str, Any]) -> bool:
    """Whether the scenario's simulated environments raise."""
    env = recipe["simulate"].get("env", {})
    return "env" in recipe and (env.get("error_prob", 0.0) > 0 or env.get("transient_prob", 0.0) > 0)


def is_fault_free(cfg: Config) -> bool:
    scripted, teacher = cfg.simulate, cfg.distill
    env_raises = cfg.env is not None and (scripted.env.error_prob > 0 or scripted.env.transient_prob > 0)
    faultless_teacher = cfg.algorithm != "distill" or (
        scripted.teacher_error_rate == 0 and (scripted.teacher_latency_s.high or 0) < teacher.timeout_s
    )
    return (not scripted.faults and not scripted.weight_sync_faults and cfg.reward.functions == ["builtin:coin"]
            and not env_raises and faultless_teacher)


def flaky_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """The coin reward, except that it raises for about one completion in 30 (deterministically), so the
    chaos suite drives the reward_error paths (fatal, or a dropped group with reward.on_error: drop)."""
    for completion in completions:
        if hashlib.blake2b(completion.encode(), digest_size=2).digest()[0] < 9:
            raise ValueError(f"flaky reward refuses {completion!r}")
    return coin_reward(prompts, completions, **columns)


def resume_scenario(seed: int) -> dict[str, Any] | None:
    """Scenario `seed` under `rollout.on_stale: resume`, its limits drawn from a stream of their own (None: the scenario
    distils, which resume does not support)."""
    recipe = scenario(seed)
    if recipe.get("algorithm") == "distill":
        return None
    rng = random.Random(f"resume:{seed}")
    recipe["rollout"].update(on_stale="resume", partial_groups=False, max_resumptions=rng.randint(0, 4),
                             max_masked_share=rng.choice((0.0, 0.3, 0.5, 1.0)))
    if rng.random() < 0.5:  # short steps: versions move on while rollouts run, so they are resumed and masked
        recipe["simulate"]["step_time_s"] = round(rng.uniform(0.05, 0.5), 3)
        recipe["generation"]["weight_sync_every"] = 1
        recipe["rollout"]["max_staleness"] = rng.randint(0, 1)
        recipe["train"]["max_steps"] = rng.randint(4, 8)
    if rng.random() < 0.3:
        recipe["rollout"]["max_prefix_staleness"] = recipe["rollout"]["max_staleness"] + rng.randint(0, 3)
    return recipe
