"""One agent session's conversation: what the agent sends checked against what it was given, in tokens.

Job: `Session.plan_chat(request)` / `plan_text(request)` turn a request of the session into the ids
the model continues (checking it against the limits), and `add_turn(completion)` records the model's
answer, exactly as sampled, and returns it parsed for the agent. The training sample is built from
`conversation` (environments/conversation.py): the prompt is the first request's rendering (its
messages and tools through the chat template), each model turn's ids as sampled (loss mask 1), and
everything the agent adds between turns (tool results, user messages) as the chat-template delta
(loss mask 0, drift counted as episodes count it).

A session is in chat mode (/v1/chat/completions) or text mode (/v1/completions) from its first
request. A later request *extends* the conversation when, in chat mode, it repeats the conversation
so far (the first request's messages, then each assistant turn as it was returned and what the agent
added), adds at least one message and keeps the tools; in text mode when its prompt starts with the
text so far (the first prompt and every answer and addition since) and adds to it. One that does not
*diverges* (the agent rewrote its history: smolagents sends a tool call back as text and its result
as a user message). With `split` off (`env.agent_history: strict`) it is refused. With `split` on it
starts a new *sample* of the session: its prompt is the request's messages (or prompt) as sent,
rendered through the chat template with the request's tools, and the episode's training samples are
`samples()`, each ended where the next began. A request that repeats the conversation and adds
nothing is refused either way (it would be a second answer to the same turn).

Invariants: a refused request (`Refused`) leaves the session as it was; the model's text is never
re-tokenized within a sample (the conversation keeps its own copy of each turn's text, not the
agent's); limits: `max_turns` model turns over the whole session, `max_tokens` tokens after the
first sample's prompt, a first prompt of at most `max_prompt_tokens` tokens; a later sample's prompt
and what follows it fit in `max_prompt_tokens + max_tokens`, the most context a sample that extends
could reach.
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

    def __init__(self, codec: Codec, limits: Limits, agent: str, name: str, *, split: bool = False) -> None:
        self._codec = codec
        self.limits = limits
        self.agent = agent
        self.split = split  # env.agent_history: split: a diverging request starts a new sample
        self.affinity = Affinity(name)  # its turns' requests carry it: one server answers them all (generation/http.py)
        self.mode: str | None = None
        self.conversation: Conversation | None = None  # the current sample's
        self.earlier: list[Conversation] = []  # the samples before it (split), in order
        self.room = limits.max_tokens  # tokens the current sample may hold after its prompt
        self.tools: tuple[dict[str, Any], ...] = ()
        self.public: list[dict[str, Any]] = []  # chat mode: the messages as the agent holds them
        self.first: list[dict[str, Any]] = []  # chat mode: the first request's messages (the episode's prompt)
        self.prompt_messages = 0  # of `public`: those of the episode's prompt
        self.text = ""  # text mode: the text so far
        self.turns = 0
        self.unparsed_tool_calls = 0
        self.limit_hit: str | None = None  # "max_turns" or "max_tokens": a request was refused at that limit

    # ------------------------------------------------------------------ requests

    def plan_chat(self, request: ChatRequest) -> tuple[tuple[int, ...], int]:
        """The ids the model continues for this request and its most new tokens; `Refused` if it cannot be served."""
        messages = list(request.messages)
        if self.conversation is None:
            self._start_chat(messages, request.tools)
            self.mode, self.first = "chat", messages
            return self._plan(request.max_tokens)
        self._check_mode("chat", "/v1/chat/completions")
        if request.tools != self.tools and not self.split:
            raise self._diverges("tools differ from the session's first request: the prompt was rendered with those. Fix: send the "
                                 "same tools in every request of an episode.")
        self._check_turns()
        divergence = self._chat_divergence(messages, request.tools)
        if divergence is not None:
            if not self.split:
                raise self._diverges(divergence)
            self._start_chat(messages, request.tools)
            return self._plan(request.max_tokens)
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
            self._start_text(request.prompt)
            self.mode = "text"
            return self._plan(request.max_tokens)
        self._check_mode("text", "/v1/completions")
        self._check_turns()
        if request.prompt == self.text or (not request.prompt.startswith(self.text) and not self.split):
            raise Refused("malformed", f"the prompt does not extend the session's text so far ({len(self.text)} characters, ending "
                          f"{self.text[-40:]!r}). Fix: send the previous prompt, the answer as it came, then what you add"
                          + ("." if request.prompt == self.text else "; or, for an agent that rewrites its text, set "
                             "env.agent_history: split (each such request starts a new sample of the episode; docs/agents.md)."))
        if not request.prompt.startswith(self.text):
            self._start_text(request.prompt)
            return self._plan(request.max_tokens)
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

    def samples(self) -> list[Conversation]:
        """The session's samples in order: one, or one per divergence and the first (split)."""
        return [*self.earlier, *([self.conversation] if self.conversation is not None else [])]

    def episode_messages(self) -> Sequence[Message]:
        """The conversation after the prompt as the agent saw it (assistant turns parsed), for the reward functions: in chat
        mode the last request's messages after those it shares with the first (the agent's own account of the episode),
        then the answer; in text mode what followed each sample's prompt, sample after sample."""
        if self.mode == "chat":
            return self.public[self.prompt_messages:]
        return [m for conv in self.samples() for m in conv.episode_messages()]

    # ------------------------------------------------------------------ samples

    @staticmethod
    def _diverges(why: str) -> Refused:
        return Refused("malformed", why + " Or, for an agent that rewrites its history, set env.agent_history: split (each such "
                       "request starts a new sample of the episode; docs/agents.md).")

    def _chat_divergence(self, messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]) -> str | None:
        """Why a later chat request does not extend the conversation (None: it does, or only repeats it)."""
        if tools != self.tools:
            return "the request's tools differ from the conversation's."
        for i, (given, held) in enumerate(zip(messages, self.public)):
            if comparable(given) != comparable(held):
                return (f"messages[{i}] = {given!r} is not the session's message {held!r}: a request must repeat the conversation so "
                        "far (assistant turns as they were returned) and add to it. Fix: append to the messages you sent, with each "
                        "response's message as it came.")
        if len(messages) < len(self.public) and self.split:
            return f"the request drops the conversation's last {len(self.public) - len(messages)} messages."
        return None

    def _start_chat(self, messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]) -> None:
        """A sample whose prompt is `messages` with `tools` (the session's first, or a new one: the current one ends)."""
        codec = ToolsCodec(self._codec, tools)
        if not codec.has_template:
            raise Refused("unsupported", "the model's tokenizer has no chat template, so chat messages cannot be rendered. Fix: use "
                          "/v1/completions, or a model with a chat template.")
        if tools and codec.render(messages, add_generation_prompt=True) == self._codec.render(messages, add_generation_prompt=True):
            raise Refused("unsupported", f"tools = [{', '.join(t['function']['name'] for t in tools)}]: the model's chat "
                          "template does not render tools, so the model would never see them. Fix: describe the tools in a message "
                          "and read the calls from the text, or use a model whose template renders tools (Qwen, Hermes, SmolLM3).")
        ids, room = self._prompt_ids(codec, codec.render(messages, add_generation_prompt=True))
        self._next_sample(Conversation(codec, Prompt(id=-1, text="", token_ids=ids, messages=tuple(messages))), room)
        self.tools, self.public = tools, messages
        shared = next((i for i, (a, b) in enumerate(zip(messages, self.first)) if comparable(a) != comparable(b)),
                      min(len(messages), len(self.first)))
        self.prompt_messages = len(messages) if not self.first else shared

    def _start_text(self, prompt: str) -> None:
        ids, room = self._prompt_ids(self._codec, prompt)
        self._next_sample(Conversation(self._codec, Prompt(id=-1, text=prompt, token_ids=ids)), room)
        self.text = prompt

    def _next_sample(self, conversation: Conversation, room: int) -> None:
        """Make `conversation` the current sample; the one before it (if any) ends with its last model turn."""
        if self.conversation is not None:
            self.conversation.check_final_drift()
            self.earlier.append(self.conversation)
        self.conversation, self.room = conversation, room

    def _prompt_ids(self, codec: Codec, text: str) -> tuple[tuple[int, ...], int]:
        """A sample's prompt ids and the tokens it may hold after them (see the module docstring's limits)."""
        first = self.conversation is None
        limit = self.limits.max_prompt_tokens if first else self.limits.max_prompt_tokens + self.limits.max_tokens - 1
        if len(text) > limit * codec.max_token_chars:  # cannot fit: never encoded
            raise self._prompt_too_long(f"{len(text)} characters", first)
        ids = codec.encode(text)
        if len(ids) > limit:
            raise self._prompt_too_long(f"{len(ids)} tokens", first)
        return ids, self.limits.max_tokens if first else self.limits.max_prompt_tokens + self.limits.max_tokens - len(ids)

    def _prompt_too_long(self, size: str, first: bool) -> Refused:
        if first:
            return Refused("context_limit", f"the first request's prompt is {size}, more than data.max_prompt_tokens = "
                           f"{self.limits.max_prompt_tokens} tokens. Fix: send a shorter prompt, or raise data.max_prompt_tokens.")
        self.limit_hit = "max_tokens"
        return Refused("context_limit", f"the request starts a new sample (env.agent_history: split) whose prompt is {size}, leaving no "
                       f"room for a model token in data.max_prompt_tokens + env.max_tokens = {self.limits.max_prompt_tokens} + "
                       f"{self.limits.max_tokens} tokens. Fix: end the episode sooner, send a shorter history, or raise env.max_tokens.")

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
        left = self.room - conv.generated
        fits = sum(len(str(m.get("content", ""))) for m in added) <= left * self._codec.max_token_chars
        drift = conv.drift_turns
        ids = conv.delta(added) if fits else None
        if ids is None or len(ids) >= left:  # no room for a model token after them
            conv.drift_turns = drift  # refused: nothing of these messages is kept, their drift included
            self.limit_hit = "max_tokens"
            where = (f"the episode's env.max_tokens = {self.limits.max_tokens} tokens" if not self.earlier else
                     f"the {self.room} tokens this sample's prompt leaves of data.max_prompt_tokens + env.max_tokens")
            raise Refused("context_limit", f"{what} do not fit in {where} ({conv.generated} used). Fix: end the episode sooner, send "
                          "shorter tool results, or raise env.max_tokens.")
        conv.observe(added, ids)

    def _plan(self, max_tokens: int | None) -> tuple[tuple[int, ...], int]:
        conv = self.conversation
        assert conv is not None
        budget = min(self.limits.max_new_tokens, self.room - conv.generated, max_tokens or self.limits.max_new_tokens)
        return conv.context, budget
