"""Tool calls in the model's text, parsed into OpenAI `tool_calls` (Hermes / Qwen / SmolLM2 format).

Job: `parse_tool_calls(text, turn)` splits an assistant turn into its text content and the calls it
makes. A call is a `<tool_call>...</tool_call>` block holding a JSON object `{"name": str,
"arguments": object | JSON string}` (Hermes, Qwen) or a JSON list of such objects (SmolLM2's
tool-calling prompt). The calls are returned in order with ids `call_<turn>_<i>` and their arguments
as a JSON string, as the OpenAI API gives them.

Invariants: never raises on any text. A turn with a block that is not such JSON, or an opened and
never closed block, is returned whole as text with no calls and `unparsed` True (the gateway counts
it): a half-parsed turn would hide the model's mistake from the agent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn as the OpenAI API returns it: `content` (None when the turn is only calls) and `tool_calls`."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...] = ()
    unparsed: bool = False


def parse_tool_calls(text: str, turn: int) -> ParsedTurn:
    """The turn's content and tool calls (see the module docstring)."""
    if OPEN not in text:
        return ParsedTurn(content=text)
    calls: list[tuple[str, str]] = []
    for block in _BLOCK.findall(text):
        parsed = _calls(block)
        if parsed is None:
            return ParsedTurn(content=text, unparsed=True)
        calls.extend(parsed)
    rest = _BLOCK.sub("", text)
    if OPEN in rest or not calls:  # a block opened and never closed (cut by max_tokens), or empty blocks only
        return ParsedTurn(content=text, unparsed=True)
    content = rest.strip() or None
    return ParsedTurn(
        content=content,
        tool_calls=tuple(
            {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ),
    )


def _calls(block: str) -> list[tuple[str, str]] | None:
    """The (name, JSON arguments) of one block's call or list of calls; None when it is not of that shape."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        out.append((item["name"], json.dumps(arguments)))
    return out or None
