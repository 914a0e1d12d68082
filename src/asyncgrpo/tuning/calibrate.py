"""Calibrate the simulator from a run: fit every model (fit.py) and write the recipe `asyncgrpo simulate` runs.

Job: `calibrate(records)` gives a `Calibration`: the fits and `recipe`, the run's own config with the
scripted backend's token model, faults and weight-sync time and the stub trainer's time per token in
its simulate: section (generation.backend: scripted, train.backend: stub, train.max_steps: the run's
steps); `write_tuned` writes it as RUN_DIR/tuned.yaml. `with_overrides` makes a variant of a recipe.

Invariants: the recipe validates as a Config (ConfigError otherwise: a bug here); every number comes
from the run's records, none is assumed. The trainer's per-step overhead (`simulate.step_overhead_s`) is
simulated only when the steps show one (fit.py); evaluation time (`simulate.eval_s`) is the mean of the
evaluations inside the training loop (the baseline, before it, is not the loop's time).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config import Config
from asyncgrpo.config.loading import validate_config
from asyncgrpo.rundir import TUNED_FILE
from asyncgrpo.tuning.fit import DecodeFit, LengthFit, TrainerFit, fit_decode, fit_faults, fit_lengths, fit_trainer, mean_or_zero
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

    def to_json(self) -> dict[str, Any]:
        return {"lengths": asdict(self.lengths), "decode": asdict(self.decode), "trainer": asdict(self.trainer),
                "faults": self.faults, "weight_sync_s": self.weight_sync_s, "eval_s": self.eval_s}


def calibrate(records: RunRecords) -> Calibration:
    """Every model of the simulator fitted to `records`, and the recipe that runs them."""
    cfg = records.config
    finished = [r for r in records.rollouts if r["outcome"] == "finished"]
    lengths = fit_lengths(((r["prompt"], r["tokens"]) for r in finished), cfg.generation.max_new_tokens)
    decode = fit_decode(records.rollouts, [(e["span"][0], e["span"][1]) for e in records.evals])
    trainer = fit_trainer([(s["train"][1] - s["train"][0], t) for s, t in zip(records.steps, records.trained_tokens)])
    outcomes = Counter(r["outcome"] for r in records.rollouts)
    for key in ("finished", "failed", "cancelled"):
        outcomes[key] += records.unrecorded.get(key, 0)
    m = records.last_metrics
    faults = fit_faults(finished=outcomes["finished"], failed=outcomes["failed"], cancelled=outcomes["cancelled"],
                        retries=int(m.get("rollout/retries_total") or 0), takes=len(records.takes),
                        invalid_prompts=int(m.get("rollout/dropped/invalid_prompt") or 0))
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
    }
    data = cfg.model_dump(mode="json")
    data["simulate"] = {**data.get("simulate", {}), **simulate}
    data["generation"]["backend"] = "scripted"
    data["train"]["backend"] = "stub"
    data["train"]["max_steps"] = len(records.steps)
    validate_config(data, "the calibrated recipe")
    return Calibration(lengths, decode, trainer, faults, weight_sync_s, eval_s, data)


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
