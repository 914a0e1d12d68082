"""The simulate: section: the simulator's models of a generation server, a trainer, a teacher and environments.

Only `asyncgrpo simulate` (and tests that stand a stub trainer beside a real server) read it: the scripted
backend (generation.backend: scripted, generation/scripted.py), the stub trainer (train.backend: stub,
training/stub.py), the simulated teacher (distill/simulated.py) and the simulated environments
(environments/simulated.py). A production recipe leaves it out; its defaults cost nothing.

Invariant: every random quantity is a `Distribution` whose parameters are checked against its kind.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncgrpo.config.section import Section


class Distribution(Section):
    """A random quantity of the simulator: const (value), uniform (low, high) or lognormal (median, sigma)."""

    dist: Literal["const", "uniform", "lognormal"] = Field("const", description="The distribution; it names the fields it needs.")
    value: float | None = Field(None, ge=0, description="const: the value.")
    low: float | None = Field(None, ge=0, description="uniform: the lower bound.")
    high: float | None = Field(None, ge=0, description="uniform: the upper bound.")
    median: float | None = Field(None, gt=0, description="lognormal: the median.")
    sigma: float | None = Field(None, ge=0, description="lognormal: the standard deviation of the log.")
    max: float | None = Field(None, gt=0, description="Upper clamp on sampled values.")

    @model_validator(mode="after")
    def _parameters_present(self) -> Distribution:
        needed = {"const": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma")}[self.dist]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"dist '{self.dist}' needs {', '.join(needed)}; missing {', '.join(missing)}")
        if self.dist == "uniform" and self.low > self.high:  # type: ignore[operator]
            raise ValueError(f"uniform needs low <= high, got low={self.low}, high={self.high}")
        return self


FaultKind = Literal["http_500", "http_429", "http_400", "http_404", "connection_refused", "hang", "exception", "prompt_too_long"]


class FaultConfig(Section):
    """One injected fault: with probability `rate` per request attempt, inside [from_s, until_s) of virtual time, or always for `prompts`."""

    error: FaultKind = Field(
        description="What the attempt does: http_500, http_429 or connection_refused (retried), http_400 (fails the rollout), http_404 "
        "(fatal at once), exception (a RuntimeError), hang (never answers) or prompt_too_long (the prompt is dropped as invalid).",
    )
    rate: float = Field(1.0, ge=0, le=1, description="Probability per request attempt inside the window.")
    from_s: float = Field(0.0, ge=0, description="Start of the window, in seconds of virtual time.")
    until_s: float | None = Field(None, gt=0, description="End of the window, in seconds of virtual time (null: the end of the run).")
    prompts: list[int] | None = Field(None, description="Only these prompt ids (then `rate` applies to them).")


class WeightSyncFaultConfig(Section):
    """One injected weight-publication fault: with probability `rate` per publication, inside [from_s, until_s)."""

    error: Literal["fail", "hang"] = Field(
        description="fail: the publication raises WeightSyncError (fatal); hang: it never returns (generation.weight_sync_timeout_s ends it).",
    )
    rate: float = Field(1.0, ge=0, le=1, description="Probability per publication inside the window.")
    from_s: float = Field(0.0, ge=0, description="Start of the window, in seconds of virtual time.")
    until_s: float | None = Field(None, gt=0, description="End of the window, in seconds of virtual time (null: the end of the run).")


class ScriptedEnvConfig(Section):
    """The simulator's model of an environment (used instead of env.factory by asyncgrpo simulate)."""

    call_s: Distribution = Field(default_factory=lambda: Distribution(dist="const", value=0.2), description="Virtual time of one reset or step.")
    done_prob: float = Field(0.3, ge=0, le=1, description="Probability that a step ends the episode (when done_probs is null).")
    done_probs: list[float] | None = Field(
        None, min_length=1,
        description="Probability that a step ends the episode, per step index: the first entry for an episode's first step, the second "
        "for its second, the last repeating for every later step. null: done_prob for every step. asyncgrpo tune fits it.",
    )
    reward_prob: float = Field(0.5, ge=0, le=1, description="Probability that a step gives reward 1.0 (else 0.0).")
    observation_chars: int = Field(
        4, ge=0, description="Characters of a step's observation (one token each under the simulator's codec, besides its role's "
        "rendering): the environment tokens an episode's trainer and env.max_tokens count. asyncgrpo tune fits it to a run's.",
    )
    error_prob: float = Field(0.0, ge=0, le=1, description="Probability that a reset or step raises (fails the rollout).")
    transient_prob: float = Field(0.0, ge=0, le=1, description="Probability that a reset or step raises TransientEnvironmentError (retried).")
    ignore_cancel_prob: float = Field(
        0.0, ge=0, le=1, description="Probability that an episode ignores its cancellation: it outlives env.cancel_grace_s and is abandoned.",
    )
    stop_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=0.01),
        description="Virtual time a cooperative episode takes to stop once cancelled (longer than the grace: abandoned).",
    )

    @field_validator("done_probs")
    @classmethod
    def _probabilities(cls, probs: list[float] | None) -> list[float] | None:
        bad = [f"entry {i} is {p}" for i, p in enumerate(probs or ()) if not 0 <= p <= 1]
        if bad:
            raise ValueError(f"each entry is a probability, in [0, 1]: {', '.join(bad)}")
        return probs


class TokenModelConfig(Section):
    """The scripted backend's token model: lengths drawn per prompt, latency from tokens (generation/scripted.py)."""

    rollout_sigma: float = Field(
        0.3, ge=0,
        description="Spread of one rollout's length around its prompt's: the lognormal sigma of a factor of median 1. The prompt's "
        "length is drawn from simulate.tokens once per (run seed, prompt id), so a group's members share it and it "
        "survives requeues.",
    )
    prefill_s: float = Field(0.0, ge=0, description="Time to the first token of a request.")
    decode_s_per_token: float = Field(0.001, gt=0, description="Time per generated token of a sequence decoded at full speed.")
    batch_knee: int = Field(
        64, ge=1,
        description="Requests the server decodes at full per-sequence speed; with n > batch_knee open at dispatch, each token takes "
        "n / batch_knee times longer, so the server's throughput saturates at batch_knee sequences' worth.",
    )


class ContentionConfig(Section):
    """Generation and training sharing hardware (the local engine and the trainer on the same cores, one GPU for both):
    each side runs this many times slower while the other is busy (generation/contention.py). 1.0: independent resources."""

    decode: float = Field(
        1.0, ge=1,
        description="Factor on the scripted backend's decode time (prefill and tokens) while the stub trainer trains a step. "
        "asyncgrpo tune fits it from a run's rollouts that overlapped training and those that did not.",
    )
    train: float = Field(
        1.0, ge=1,
        description="Factor on the stub trainer's step time while at least one request decodes. asyncgrpo tune fits it from "
        "the run's train spans, split into the time generation was busy and the time it was not.",
    )


class SimulateConfig(Section):
    """The simulator's models (asyncgrpo simulate): the scripted backend's latency, lengths and faults
    (generation.backend: scripted), the stub trainer's step time (train.backend: stub), the simulated teacher
    (algorithm: distill) and the simulated environments (with an env: section). A production recipe leaves it out."""

    latency_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=1.0),
        description="Latency of one attempt, drawn independently of its length (unused with token_model).",
    )
    tokens: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=32),
        description="Completion length: drawn per attempt, or with token_model once per prompt (then spread per rollout).",
    )
    token_model: TokenModelConfig | None = Field(
        None,
        description="Opt-in: lengths drawn per prompt and latency = prefill_s + tokens x decode time slowed by concurrency, "
        "instead of latency_s drawn apart from the length.",
    )
    faults: list[FaultConfig] = Field(
        default_factory=list,
        description="Injected request faults, each {error, rate, from_s, until_s, prompts}: error is one of http_500, http_429, "
        "http_400, http_404, connection_refused, hang, exception, prompt_too_long; rate is the probability per attempt inside "
        "[from_s, until_s) of virtual time, or for the listed prompt ids only.",
    )
    weight_sync_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=0.0),
        description="Virtual time one weight publication takes; the old version is served until it ends.",
    )
    weight_sync_faults: list[WeightSyncFaultConfig] = Field(
        default_factory=list, description="Injected weight-publication faults, each {error: fail | hang, rate, from_s, until_s}.",
    )
    env: ScriptedEnvConfig = Field(
        default_factory=ScriptedEnvConfig, description="The simulated environments, used instead of env.factory.",
    )
    step_time_s: float = Field(1.0, gt=0, description="Virtual duration of one step of the stub trainer.")
    token_time_s: float | None = Field(
        None, gt=0, description="A stub-trainer step takes this times its batch's completion tokens instead of step_time_s.",
    )
    step_overhead_s: float = Field(
        0.0, ge=0,
        description="With token_time_s: virtual time a stub-trainer step takes besides its tokens (the optimizer step, bookkeeping), "
        "added to token_time_s x its tokens.",
    )
    eval_s: float = Field(
        0.0, ge=0,
        description="Virtual time one evaluation takes, after every eval.every_steps steps (as a training run evaluates; generation "
        "goes on meanwhile). 0: evaluation takes no time.",
    )
    contention: ContentionConfig = Field(
        default_factory=ContentionConfig,
        description="Generation and training sharing hardware: {decode, train}, each side's slowdown while the other is busy "
        "(1.0, the default: independent resources).",
    )
    teacher_latency_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=0.05),
        description="algorithm: distill: virtual time the simulated teacher takes per batch.",
    )
    teacher_error_rate: float = Field(0.0, ge=0, le=1, description="algorithm: distill: probability that a simulated teacher batch fails.")
