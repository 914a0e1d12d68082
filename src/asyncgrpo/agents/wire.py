"""The OpenAI wire format of the gateway: requests read into checked values, responses built from a turn.

Job: `chat_request(body)` and `text_request(body)` read a /v1/chat/completions or /v1/completions body
into the messages (or prompt), tools and the most new tokens it asks for; `chat_response` and
`text_response` build the answers. `Refused` is a request answered with an HTTP error, whose
message names the field, the value and the fix (the openai client raises it in the agent).

Invariants: nothing here touches a session or the tokenizer; a body that is not of the documented
shape is `Refused` ("malformed", HTTP 400), never half-read. Sampling fields other than the token
limit (temperature, top_p, seed, stop, ...) are accepted and ignored: the run's sampling settings
apply, since the trainer scores the distribution that was sampled.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from asyncgrpo.agents.toolcalls import ParsedTurn
from asyncgrpo.types import Completion

ROLES = ("system", "developer", "user", "assistant", "tool")
# Why a request was refused (metric_names.AGENT_REFUSALS, counted as agent/refused/<reason>; an unknown session's refusal has no
# episode to be counted under) and the HTTP status the client sees.
REFUSALS = {"malformed": 400, "unsupported": 400, "turn_limit": 400, "context_limit": 400, "after_close": 410, "unknown_session": 404}


class Refused(Exception):
    """A request answered with an HTTP error; `reason` is one of `REFUSALS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = REFUSALS[reason]

    def body(self) -> dict[str, Any]:
        code = "context_length_exceeded" if self.reason == "context_limit" else self.reason
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": None, "code": code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    max_tokens: int | None
    model: str


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    max_tokens: int | None
    model: str


def chat_request(body: Any) -> ChatRequest:
    common = _common(body, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("malformed", f"messages = {_short(messages)}: give a non-empty list of chat messages.")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise Refused("malformed", f"tools = {_short(tools)}: give a list of function tools or leave it out.")
    return ChatRequest(messages=tuple(message(m, i) for i, m in enumerate(messages)), tools=tuple(_tool(t, i) for i, t in enumerate(tools)),
                       max_tokens=common[0], model=common[1])


def text_request(body: Any) -> TextRequest:
    max_tokens, model = _common(body, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise Refused("malformed", f"prompt = {_short(prompt)}: give one non-empty string (a session is one conversation).")
    return TextRequest(prompt=prompt, max_tokens=max_tokens, model=model)


def _common(body: Any, path: str) -> tuple[int | None, str]:
    if not isinstance(body, dict):
        raise Refused("malformed", f"the body of {path} is {_short(body)}, not a JSON object. Fix: send the OpenAI request object.")
    if body.get("stream"):
        raise Refused("unsupported", "stream = true: the gateway answers whole responses only. Fix: leave stream out (or false).")
    n = body.get("n", 1)
    if n not in (1, None):
        raise Refused("unsupported", f"n = {_short(n)}: a session is one episode, one answer per request. Fix: leave n out (the run samples "
                      "the group: rollout.group_size).")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (type(limit) is not int or limit < 1):
        raise Refused("malformed", f"max_tokens = {_short(limit)}: give a positive integer or leave it out.")
    model = body.get("model", "")
    return limit, model if isinstance(model, str) else ""


def message(m: Any, index: int) -> dict[str, Any]:
    """One chat message in the shape the chat template reads: role, content as a string, tool calls with their arguments as
    an object, a tool result's tool_call_id and name."""
    where = f"messages[{index}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise Refused("malformed", f"{where} = {_short(m)}: give an object whose role is one of {', '.join(ROLES)}.")
    out: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), where)}
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise Refused("malformed", f"{where}.tool_calls = {_short(calls)}: only an assistant message has tool_calls, a list.")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise Refused("malformed", f"{where}.content = {_short(content)}: give a string or a list of text parts (the model reads text only).")


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Refused("malformed", f"{where} = {_short(call)}: give {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}.")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise Refused("malformed", f"{where}.function.arguments = {_short(arguments)} is not JSON. Fix: send the arguments as the "
                          "response gave them.") from None
    if not isinstance(arguments, dict):
        raise Refused("malformed", f"{where}.function.arguments = {_short(arguments)}: give a JSON object.")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tool(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Refused("malformed", f"tools[{index}] = {_short(tool)}: give {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                      "...}}}}.")
    return {"type": "function", "function": dict(function)}


def comparable(m: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a message the agent sends back to be the one the session holds (call ids and the
    arguments' spelling aside)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls", ()))
    return m["role"], m["content"], calls


def assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    """The turn as the session keeps it (`message`'s shape), to check the history the agent sends back."""
    out: dict[str, Any] = {"role": "assistant", "content": turn.content or ""}
    if turn.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in turn.tool_calls]
    return out


def finish_reason(completion: Completion, turn: ParsedTurn) -> str:
    if completion.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.tool_calls else "stop"


def chat_response(ident: str, model: str, turn: ParsedTurn, completion: Completion, prompt_tokens: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = list(turn.tool_calls)
    return {
        "id": ident, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(completion, turn), "logprobs": None}],
        "usage": _usage(prompt_tokens, completion),
    }


def text_response(ident: str, model: str, completion: Completion, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": completion.text, "finish_reason": "length" if completion.truncated else "stop", "logprobs": None}],
        "usage": _usage(prompt_tokens, completion),
    }


def _usage(prompt_tokens: int, completion: Completion) -> dict[str, int]:
    n = len(completion.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
