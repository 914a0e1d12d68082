"""Calibrate the simulator from a run: fit every model (fit.py) and write the recipe `asyncgrpo simulate` runs.

Job: `calibrate(records, pool)` gives a `Calibration`: the fits and `recipe`, the run's own config with the
scripted backend's token model, faults and weight-sync time and the stub trainer's time per token in
its simulate: section (generation.backend: scripted, train.backend: stub, train.max_steps: the run's
steps), decode and trainer time fitted to the pooled runs' spans too (`timing`); `write_tuned` writes it as
RUN_DIR/tuned.yaml. `with_overrides` makes a variant of a recipe.

Invariants: the recipe validates as a Config (ConfigError otherwise: a bug here) and runs in one process (runtime: local,
no launched servers, one trainer rank: a Ray run's actors are in its fitted times); every number comes
from the run's records, none is assumed. The trainer's per-step overhead (`simulate.step_overhead_s`) is
simulated only when the steps show one (fit.py); evaluation time (`simulate.eval_s`) is the mean of the
evaluations inside the training loop (the baseline, before it, is not the loop's time). Where the run shows that
generation and training slowed each other (the local engine and the trainer on shared cores), `simulate.contention`
has each side's slowdown and the fitted times are those at full speed; else it is 1.0 (independent). A run that
plays episodes (env:) is fitted per turn, as the simulator draws and decodes one request per turn (lengths and decode time
from its "turn" lines), `simulate.env` from its environment calls (fit.py `fit_env`; its observations as long, in the
simulator's codec, as the run's were in tokens; its error rates from env/errors_total and the rollouts failed in an
environment call, fit_env_errors), the generation's faults per turn and less the environment's (both count in
rollout/retries_total and rollout/failed_total), and the trainer's time per completion token, the environment's included
(what the trainer and the stub trainer process). Lengths are fitted with those cut at their budget censored (lengths.py).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config import Config
from asyncgrpo.config.loading import validate_config
from asyncgrpo.data.loading import build_prompts, read_rows
from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.rundir import TUNED_FILE
from asyncgrpo.tuning.contention import Overlap, busy_windows
from asyncgrpo.tuning.fit import (
    DecodeFit,
    EnvFit,
    TrainerFit,
    env_times,
    fit_decode,
    fit_env,
    fit_env_errors,
    fit_faults,
    fit_trainer,
    mean_or_zero,
)
from asyncgrpo.tuning.lengths import LengthFit, fit_lengths
from asyncgrpo.tuning.records import RunRecords


@dataclass(frozen=True)
class Calibration:
    lengths: LengthFit
    decode: DecodeFit
    trainer: TrainerFit
    faults: list[dict[str, Any]]
    weight_sync_s: float
    eval_s: float  # mean time of an evaluation inside the training loop (simulate.eval_s)
    recipe: dict[str, Any]
    env: EnvFit | None = None  # with an env: section, the simulated environment (simulate.env)

    def to_json(self) -> dict[str, Any]:
        return {"lengths": asdict(self.lengths), "decode": asdict(self.decode), "trainer": asdict(self.trainer),
                "faults": self.faults, "weight_sync_s": self.weight_sync_s, "eval_s": self.eval_s,
                "env": None if self.env is None else asdict(self.env)}


@dataclass(frozen=True)
class Timing:
    """The spans the decode and trainer fits read, of one run or of several laid end to end on one clock."""

    rollouts: list[dict[str, Any]]  # the generation requests (RunRecords.requests: with episodes, their turns)
    evals: list[tuple[float, float]]
    training: list[tuple[float, float]]  # train spans
    trained_tokens: list[int]  # per train span (RunRecords.trainer_tokens: with episodes, the environment's tokens too)


def timing(runs: Sequence[RunRecords]) -> Timing:
    """The runs' spans, each run after the one before (its times shifted past the other's last), so that no span of one run
    counts as open, training or decoding during another's; each run's first step (a warm-up) is left out but the first run's
    (fit_trainer leaves that one out itself)."""
    pooled = Timing([], [], [], [])
    offset = 0.0
    for index, run in enumerate(runs):
        pooled.rollouts.extend({**r, "start": r["start"] + offset, "end": r["end"] + offset} for r in run.requests)
        pooled.evals.extend((e["span"][0] + offset, e["span"][1] + offset) for e in run.evals)
        steps = list(zip(run.steps, run.trainer_tokens))[0 if index == 0 else 1:]
        pooled.training.extend((s["train"][0] + offset, s["train"][1] + offset) for s, _ in steps)
        pooled.trained_tokens.extend(t for _, t in steps)
        ends = [r["end"] for r in run.rollouts] + [s["sync"][1] for s in run.steps] + [e["span"][1] for e in run.evals]
        offset += max(ends) + POOL_GAP_S
    return pooled


POOL_GAP_S = 1.0  # between pooled runs on the one clock: no span reaches into the next run's


def calibrate(records: RunRecords, pool: Sequence[RunRecords] = ()) -> Calibration:
    """Every model of the simulator fitted to `records`, and the recipe that runs them. Decode and trainer time are fitted
    to `pool`'s spans too (runs of the same model and backend on the same machine: check_poolable), which can show
    contention one run cannot (tuning/contention.py); everything else is `records`' own."""
    cfg = records.config
    # With episodes, each turn (the simulator draws per turn), under its own budget: env.max_tokens may have cut it (`limit`).
    lengths = fit_lengths((r["prompt"], r["tokens"], r.get("limit", cfg.generation.max_new_tokens))
                          for r in records.requests if r["outcome"] == "finished")
    spans = timing([records, *pool])
    decode = fit_decode(spans.rollouts, spans.evals, spans.training)
    decoding = Overlap(busy_windows((r["start"], r["end"]) for r in spans.rollouts))
    trainer = fit_trainer([(end - start, t) for (start, end), t in zip(spans.training, spans.trained_tokens)],
                          [decoding(start, end) for start, end in spans.training])
    outcomes = Counter(r["outcome"] for r in records.rollouts)
    for key in ("finished", "failed", "cancelled"):
        outcomes[key] += records.unrecorded.get(key, 0)
    recorded_share = len(records.rollouts) / max(1, sum(outcomes.values()))
    m = records.last_metrics
    retries, attempts = int(m.get("rollout/retries_total") or 0), outcomes["finished"]
    env = None
    if cfg.env is not None:
        errors = fit_env_errors(records.rollouts, [*records.turns, *records.env_calls], errors_total=int(m.get("env/errors_total") or 0),
                                recorded_share=recorded_share)
        env = fit_env(records.env_calls, env_times(records.rollouts, records.turns))
        env = replace(env, observation_chars=max(0, round(env.observation_tokens - _rendering_tokens(cfg))), errors=errors)
        # The generation's own faults: less the environment's, per request (a turn) rather than per rollout.
        retries, outcomes["failed"] = max(0, retries - errors.retried), max(0, outcomes["failed"] - errors.failed)
        attempts = round(len(records.turns) / recorded_share) if recorded_share > 0 else 0
    faults = fit_faults(finished=attempts, failed=outcomes["failed"], cancelled=outcomes["cancelled"], retries=retries,
                        takes=len(records.takes), invalid_prompts=int(m.get("rollout/dropped/invalid_prompt") or 0))
    weight_sync_s = mean_or_zero(s["sync"][1] - s["sync"][0] for s in records.steps)
    eval_s = mean_or_zero(e["span"][1] - e["span"][0] for e in records.evals)
    simulate = {
        "tokens": {"dist": "lognormal", "median": round(lengths.median, 6), "sigma": round(lengths.sigma, 6)},
        "token_model": {"rollout_sigma": round(lengths.rollout_sigma, 6), "prefill_s": round(decode.prefill_s, 9),
                        "decode_s_per_token": round(max(decode.decode_s_per_token, 1e-9), 9), "batch_knee": decode.batch_knee},
        "faults": faults,
        "weight_sync_s": {"dist": "const", "value": round(weight_sync_s, 9)},
        "step_time_s": round(trainer.step_time_s, 9),
        "token_time_s": round(trainer.token_time_s, 12),
        "step_overhead_s": round(trainer.overhead_s, 9),
        "eval_s": round(eval_s, 9),
        "contention": {"decode": round(decode.contention, 4), "train": round(trainer.contention, 4)},
    }
    data = cfg.model_dump(mode="json")
    data["simulate"] = {**data.get("simulate", {}), **simulate}
    if env is not None:
        data["simulate"]["env"] = {**data["simulate"].get("env", {}), **env.simulate_env()}
    data["generation"]["backend"] = "scripted"
    data["train"]["backend"] = "stub"
    # The simulator is one process: a Ray run's actors (generators, launched servers, trainer ranks) are in the fitted times.
    data["runtime"] = "local"
    data["generation"]["http"]["launch"] = None
    data["train"]["world_size"] = 1
    data["train"]["sharding"] = "ddp"  # FSDP needs two ranks; one process has nothing to shard
    data["train"]["max_steps"] = len(records.steps)
    validate_config(data, "the calibrated recipe")
    return Calibration(lengths, decode, trainer, faults, weight_sync_s, eval_s, data, env)


def _rendering_tokens(cfg: Config) -> int:
    """The simulator's environment tokens of an empty observation (environments/conversation.py's CharCodec, one token a
    character): with chat prompts its role's rendering and the next turn's generation prompt, which a run's observations
    carry too; with text prompts none (the observation's text alone)."""
    rows = read_rows(cfg.data.source, builtin_size=cfg.data.builtin_size, seed=cfg.run.seed)[:1]  # as the simulator reads them
    prompts, _ = build_prompts(rows, prompt_key=cfg.data.prompt_key, tokenizer=None, max_prompt_tokens=cfg.data.max_prompt_tokens)
    if not prompts or prompts[0].messages is None or cfg.env is None:
        return 0
    return len(CharCodec().render([{"role": cfg.env.observation_role, "content": ""}], add_generation_prompt=True))


def with_overrides(recipe: dict[str, Any], overrides: dict[str, Any]) -> Config:
    """`recipe` with dotted-key `overrides` applied, validated."""
    data = copy.deepcopy(recipe)
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return validate_config(data, f"the calibrated recipe with {overrides}")


def write_tuned(run_dir: Path, calibration: Calibration) -> Path:
    """Write the calibrated recipe as RUN_DIR/tuned.yaml; `asyncgrpo simulate` runs it."""
    path = run_dir / TUNED_FILE
    header = (f"# Written by `asyncgrpo tune {run_dir.name}`: this run's config with the simulator's models fitted to its\n"
              f"# timeline. Run it with `asyncgrpo simulate {path.name}`.\n")
    path.write_text(header + yaml.safe_dump(calibration.recipe, sort_keys=False), encoding="utf-8")
    return path


def recipe_config(recipe: dict[str, Any]) -> Config:
    """The calibrated recipe as a Config (validated on a copy: the recipe stays as written)."""
    return validate_config(copy.deepcopy(recipe), "the calibrated recipe")
