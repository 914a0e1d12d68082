"""verifiers environments as agents: an environment of the `verifiers` package plays each episode against its session.

Job: `verifiers_agent(load)` returns an agent (`env.factory: agent:<module>:<name>`, agents/episode.py) that plays
each episode as the environment `load()` returns (called once, at the first episode) plays a rollout: verifiers'
own `run_rollout`, with the session's `openai.AsyncOpenAI` as its client (wrapped in verifiers'
`OpenAIChatCompletionsClient`), so its turns, tool calls and tool results go through the gateway, and its rubric
scores the rollout. The episode's reward is the rubric's reward, its info the rubric's metrics.

The row becomes verifiers' rollout input: `prompt` (text, or chat messages), `answer` (the row's "answer" column as
text; "" without one), `info` (the row's "info" column, if any) and `example_id` (the row's "example_id", else 0).

Invariants: a rollout that verifiers ended with an error (a model call the gateway refused, a tool that raised),
or during which verifiers logged an error it then went past (a reward function that raised, which verifiers scores
0.0), raises `VerifiersRolloutError` with verifiers' message, a counted failure of the episode
(`agent/failed/raised`): never a reward. Errors are told apart per episode: the log records verifiers emits while an
episode's rollout runs go to that episode's list (a context variable; a thread verifiers starts inherits it). Supported: verifiers 0.3 (its classic
`verifiers.Environment` stack, `pip install 'asyncgrpo[verifiers]'`); not with the `openenv` extra (docs/agents.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

Agent = Callable[[Any, Mapping[str, Any]], Any]
_logged: ContextVar[list[str] | None] = ContextVar("asyncgrpo_verifiers_errors", default=None)


class _EpisodeErrors(logging.Handler):
    """Adds each error verifiers logs to the list of the episode whose rollout logged it."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _logged.get()
        if errors is not None:
            errors.append(f"{record.name}: {record.getMessage()}")


class VerifiersRolloutError(RuntimeError):
    """verifiers ended the episode's rollout with an error (its message says which)."""


def verifiers_agent(load: Callable[[], Any], *, model: str = "policy") -> Agent:
    """The agent that plays each episode as the verifiers environment `load()` returns (see the module docstring)."""
    loaded: list[Any] = []
    logger = logging.getLogger("verifiers.legacy")  # the classic stack's; verifiers' setup_logging clears "verifiers" only
    if not any(isinstance(h, _EpisodeErrors) for h in logger.handlers):
        logger.addHandler(_EpisodeErrors(logging.ERROR))

    async def agent(client: Any, row: Mapping[str, Any]) -> dict[str, Any]:
        from verifiers.clients import OpenAIChatCompletionsClient

        if not loaded:
            loaded.append(load())
        errors: list[str] = []
        _logged.set(errors)  # this episode's task's context only
        output = await loaded[0].run_rollout(rollout_input(row), OpenAIChatCompletionsClient(client), model, {})
        if output.get("error"):
            raise VerifiersRolloutError(f"verifiers ended the rollout with an error: {output['error']}")
        if errors:
            raise VerifiersRolloutError(f"verifiers logged {len(errors)} error(s) during the rollout and went on (its reward "
                                        f"would count them as 0.0): {'; '.join(errors)[:1000]}")
        return {"reward": output["reward"], **(output.get("metrics") or {})}

    return agent


def rollout_input(row: Mapping[str, Any]) -> dict[str, Any]:
    """verifiers' rollout input for `row` (see the module docstring)."""
    prompt = row["prompt"]
    rollout: dict[str, Any] = {
        "prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt],
        "example_id": row.get("example_id", 0),
        "answer": "" if row.get("answer") is None else str(row["answer"]),
    }
    if row.get("info") is not None:
        rollout["info"] = row["info"]
    return rollout
