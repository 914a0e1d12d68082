"""One agent session's conversation: what the agent sends checked against what it was given, in tokens.

Job: `Session.plan_chat(request)` / `plan_text(request)` turn a request of the session into the ids
the model continues (checking it against the limits), and `add_turn(completion)` records the model's
answer, exactly as sampled, and returns it parsed for the agent. The training sample is built from
`conversation` (environments/conversation.py): the prompt is the first request's rendering (its
messages and tools through the chat template), each model turn's ids as sampled (loss mask 1), and
everything the agent adds between turns (tool results, user messages) as the chat-template delta
(loss mask 0, drift counted as episodes count it).

A session is in chat mode (/v1/chat/completions) or text mode (/v1/completions) from its first
request. In chat mode each later request must repeat the conversation so far (the first request's
messages, then each assistant turn as it was returned and what the agent added) and add at least
one message; the tools must stay those of the first request. In text mode each later prompt must
start with the text so far (the first prompt and every answer and addition since).

Invariants: a refused request (`Refused`) leaves the session as it was; the model's text is never
re-tokenized (the conversation keeps its own copy of each turn's text, not the agent's); limits:
`max_turns` model turns, `max_tokens` tokens after the prompt, a first prompt of at most
`max_prompt_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.agents.toolcalls import ParsedTurn, parse_tool_calls
from asyncgrpo.agents.wire import ChatRequest, Refused, TextRequest, assistant_message, comparable
from asyncgrpo.environments.conversation import Codec, Conversation
from asyncgrpo.environments.protocol import Message
from asyncgrpo.types import Affinity, Completion, Prompt


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int


class ToolsCodec:
    """A codec whose renderings carry the session's tools (the chat template renders them into the prompt)."""

    def __init__(self, codec: Codec, tools: Sequence[Mapping[str, Any]]) -> None:
        self._codec = codec
        self.tools = tuple(tools)
        self.has_template = codec.has_template
        self.exact = codec.exact
        self.offload = codec.offload
        self.max_token_chars = codec.max_token_chars

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        return self._codec.render(messages, add_generation_prompt=add_generation_prompt, tools=tools or self.tools)

    def encode(self, text: str) -> tuple[int, ...]:
        return self._codec.encode(text)


class Session:
    """The bookkeeping of one session (see the module docstring); `agent` names the agent in messages, `name` the session."""

    def __init__(self, codec: Codec, limits: Limits, agent: str, name: str) -> None:
        self._codec = codec
        self.limits = limits
        self.agent = agent
        self.affinity = Affinity(name)  # its turns' requests carry it: one server answers them all (generation/http.py)
        self.mode: str | None = None
        self.conversation: Conversation | None = None
        self.tools: tuple[dict[str, Any], ...] = ()
        self.public: list[dict[str, Any]] = []  # chat mode: the messages as the agent holds them
        self.prompt_messages = 0
        self.text = ""  # text mode: the text so far
        self.turns = 0
        self.unparsed_tool_calls = 0
        self.limit_hit: str | None = None  # "max_turns" or "max_tokens": a request was refused at that limit

    # ------------------------------------------------------------------ requests

    def plan_chat(self, request: ChatRequest) -> tuple[tuple[int, ...], int]:
        """The ids the model continues for this request and its most new tokens; `Refused` if it cannot be served."""
        messages = list(request.messages)
        if self.conversation is None:
            codec = ToolsCodec(self._codec, request.tools)
            if not codec.has_template:
                raise Refused("unsupported", "the model's tokenizer has no chat template, so chat messages cannot be rendered. Fix: use "
                              "/v1/completions, or a model with a chat template.")
            if request.tools and codec.render(messages, add_generation_prompt=True) == self._codec.render(messages, add_generation_prompt=True):
                raise Refused("unsupported", f"tools = [{', '.join(t['function']['name'] for t in request.tools)}]: the model's chat "
                              "template does not render tools, so the model would never see them. Fix: describe the tools in a message "
                              "and read the calls from the text, or use a model whose template renders tools (Qwen, Hermes, SmolLM3).")
            ids = self._prompt_ids(codec, codec.render(messages, add_generation_prompt=True))
            self.mode, self.tools = "chat", request.tools
            self.conversation = Conversation(codec, Prompt(id=-1, text="", token_ids=ids, messages=tuple(messages)))
            self.public, self.prompt_messages = messages, len(messages)
            return self._plan(request.max_tokens)
        self._check_mode("chat", "/v1/chat/completions")
        if request.tools != self.tools:
            raise Refused("malformed", "tools differ from the session's first request: the prompt was rendered with those. Fix: send the "
                          "same tools in every request of an episode.")
        self._check_turns()
        for i, (given, held) in enumerate(zip(messages, self.public)):
            if comparable(given) != comparable(held):
                raise Refused("malformed", f"messages[{i}] = {given!r} is not the session's message {held!r}: a request must repeat the "
                              "conversation so far (assistant turns as they were returned) and add to it. Fix: append to the messages you "
                              "sent, with each response's message as it came.")
        added = messages[len(self.public):]
        if not added:
            raise Refused("malformed", f"the request repeats the conversation's {len(self.public)} messages and adds none. Fix: add the tool "
                          "results or the next user message (a session is one episode; open no second answer to the same turn).")
        self._observe(added, f"the {len(added)} new messages")
        self.public.extend(added)
        return self._plan(request.max_tokens)

    def plan_text(self, request: TextRequest) -> tuple[tuple[int, ...], int]:
        """As `plan_chat`, for /v1/completions."""
        if self.conversation is None:
            ids = self._prompt_ids(self._codec, request.prompt)
            self.mode, self.text = "text", request.prompt
            self.conversation = Conversation(self._codec, Prompt(id=-1, text=request.prompt, token_ids=ids))
            return self._plan(request.max_tokens)
        self._check_mode("text", "/v1/completions")
        self._check_turns()
        if not request.prompt.startswith(self.text) or len(request.prompt) == len(self.text):
            raise Refused("malformed", f"the prompt does not extend the session's text so far ({len(self.text)} characters, ending "
                          f"{self.text[-40:]!r}). Fix: send the previous prompt, the answer as it came, then what you add.")
        added = request.prompt[len(self.text):]
        self._observe([{"role": "user", "content": added}], f"the {len(added)} new characters")
        self.text = request.prompt
        return self._plan(request.max_tokens)

    def add_turn(self, completion: Completion) -> ParsedTurn:
        """The model's answer: its ids into the conversation as sampled, its text parsed for the agent."""
        assert self.conversation is not None
        self.conversation.add_model(completion)
        self.turns += 1
        if self.mode == "text":
            self.text += completion.text
            return ParsedTurn(content=completion.text)
        turn = parse_tool_calls(completion.text, self.turns) if self.tools else ParsedTurn(content=completion.text)
        self.unparsed_tool_calls += turn.unparsed
        self.public.append(assistant_message(turn))
        return turn

    def episode_messages(self) -> Sequence[Message]:
        """The conversation after the prompt as the agent saw it (assistant turns parsed), for the reward functions."""
        if self.mode == "chat":
            return self.public[self.prompt_messages:]
        return self.conversation.episode_messages() if self.conversation is not None else []

    # ------------------------------------------------------------------ helpers

    def _prompt_ids(self, codec: Codec, text: str) -> tuple[int, ...]:
        if len(text) > self.limits.max_prompt_tokens * codec.max_token_chars:  # cannot fit: never encoded
            raise self._prompt_too_long(f"{len(text)} characters")
        ids = codec.encode(text)
        if len(ids) > self.limits.max_prompt_tokens:
            raise self._prompt_too_long(f"{len(ids)} tokens")
        return ids

    def _prompt_too_long(self, size: str) -> Refused:
        return Refused("context_limit", f"the first request's prompt is {size}, more than data.max_prompt_tokens = "
                       f"{self.limits.max_prompt_tokens} tokens. Fix: send a shorter prompt, or raise data.max_prompt_tokens.")

    def _check_mode(self, mode: str, path: str) -> None:
        if self.mode != mode:
            raise Refused("malformed", f"{path} in a session that began with the other endpoint: a session is one conversation. Fix: use "
                          "one endpoint per episode.")

    def _check_turns(self) -> None:
        if self.turns >= self.limits.max_turns:
            self.limit_hit = "max_turns"
            raise Refused("turn_limit", f"the session has had its env.max_turns = {self.limits.max_turns} model turns. Fix: end the "
                          "episode sooner, or raise env.max_turns.")

    def _observe(self, added: list[dict[str, Any]], what: str) -> None:
        conv = self.conversation
        assert conv is not None
        left = self.limits.max_tokens - conv.generated
        fits = sum(len(str(m.get("content", ""))) for m in added) <= left * self._codec.max_token_chars
        drift = conv.drift_turns
        ids = conv.delta(added) if fits else None
        if ids is None or len(ids) >= left:  # no room for a model token after them
            conv.drift_turns = drift  # refused: nothing of these messages is kept, their drift included
            self.limit_hit = "max_tokens"
            raise Refused("context_limit", f"{what} do not fit in the episode's env.max_tokens = {self.limits.max_tokens} tokens "
                          f"({conv.generated} used). Fix: end the episode sooner, send shorter tool results, or raise env.max_tokens.")
        conv.observe(added, ids)

    def _plan(self, max_tokens: int | None) -> tuple[tuple[int, ...], int]:
        conv = self.conversation
        assert conv is not None
        budget = min(self.limits.max_new_tokens, self.limits.max_tokens - conv.generated, max_tokens or self.limits.max_new_tokens)
        return conv.context, budget
