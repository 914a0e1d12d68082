"""The env: section: multi-turn environments (docs/environments.md), and the longest an episode can run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from asyncgrpo.config.section import Section

if TYPE_CHECKING:
    from asyncgrpo.config.generation import GenerationConfig

# env.factory forms that name an agent, played through the run's gateway (environments/agent_spec.py), not an environment.
AGENT_PREFIX = "agent:"
AGENT_COMMAND_PREFIX = "agent-command:"


class EnvConfig(Section):
    """Multi-turn environments (docs/environments.md): each rollout is an episode of model turns and environment steps.
    Absent (null): each rollout is one completion, as without environments."""

    factory: str = Field(
        ..., min_length=1,
        description="module:callable returning a new environment (reset/step/close); called with no arguments once per episode. "
        "agent:module:function: an async agent(client, row) written against the OpenAI client, played through the run's gateway "
        "(docs/agents.md). agent-command:<command line>: an agent that is a program, run once per episode in a process group of its "
        "own with OPENAI_BASE_URL/OPENAI_API_KEY set to its session and the row as JSON on stdin, printing its reward as the last "
        "line of stdout (docs/agents.md).",
    )
    max_turns: int = Field(4, ge=1, description="Most model turns of one episode; the episode then ends (stop reason max_turns).")
    max_tokens: int = Field(
        512, ge=1,
        description="Most tokens of one episode after the prompt, the model's and the environment's together (stop reason max_tokens).",
    )
    cancel_grace_s: float = Field(
        5.0, gt=0,
        description="A cancelled episode's environment gets this long to stop (token set, close() called) before it is killed "
        "(process) or counted in env/abandoned_total (thread). A command agent's process group gets it between SIGTERM and SIGKILL.",
    )
    isolation: Literal["thread", "process"] = Field(
        "thread",
        description="Where sync environment code runs: thread (a thread of its own per episode; one that will not stop is abandoned and "
        "counted) or process (a worker process per episode slot, killed after the grace). Agents: agent:module:function runs as a "
        "task of the run (thread only); agent-command: always runs as a process of its own, whatever this says.",
    )
    step_timeout_s: float = Field(
        60.0, gt=0,
        description="Deadline of one environment call: reset (the factory included) or one step. One that outlives it is stopped as a "
        "cancelled episode is (token, close(), env.cancel_grace_s) and fails its rollout, naming the environment and the call.",
    )
    agent_history: Literal["strict", "split"] = Field(
        "strict",
        description="Agents only (agent: and agent-command:): what a request whose messages do not extend its session's conversation "
        "(an agent that rewrites its history, e.g. smolagents' tool calls sent back as text) does. strict: refused with HTTP 400 "
        "(agent/refused/malformed). split: it starts a new sample of the same episode, its prompt the request's messages as sent; "
        "every sample of the episode is trained with the episode's advantage (docs/agents.md).",
    )
    observation_role: str = Field("user", min_length=1, description="Chat role of an observation given as a plain string.")
    reward_weight: float = Field(
        1.0, ge=0, description="Weight of the environment's episode reward, added to the weighted reward functions (0: ignore it).",
    )

    @property
    def is_agent(self) -> bool:
        """The factory names an agent (agent:module:function or agent-command:<command line>), not an environment."""
        return self.factory.startswith((AGENT_PREFIX, AGENT_COMMAND_PREFIX))

    @model_validator(mode="after")
    def _agent_settings(self) -> EnvConfig:
        if self.factory.startswith(AGENT_PREFIX) and self.isolation != "thread":
            raise ValueError(f"isolation = {self.isolation!r} with factory = {self.factory!r}: an agent:module:function runs as a task of "
                             "the run's event loop (cancelled with its session), not in a worker process. Fix: set env.isolation: thread (or "
                             "leave it out), or run the agent as a process: env.factory: agent-command:python my_agent.py (a script that "
                             "prints its reward; docs/agents.md).")
        if self.agent_history != "strict" and not self.is_agent:
            raise ValueError(f"agent_history = {self.agent_history!r} with factory = {self.factory!r}: it says what an agent's "
                             "request that rewrites its history does; an environment's episode has no such requests. Fix: remove "
                             "env.agent_history, or use an agent (env.factory: agent:module:function or agent-command:...).")
        return self


def episode_limit_s(env: EnvConfig, generation: GenerationConfig) -> float:
    """The longest an episode can run: its reset, then env.max_turns turns of a generation (each within
    generation.rollout_deadline_s) and a step (each within env.step_timeout_s)."""
    return env.step_timeout_s + env.max_turns * (generation.rollout_deadline_s + env.step_timeout_s)

