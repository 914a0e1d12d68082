"""An episode's conversation, kept twice: as chat messages, and as the token ids the model actually saw.

Job: turn the environment's messages into the tokens appended to the model's context, without
ever re-rendering what the model sampled.

- `Codec` renders messages to text and encodes text to ids. `TokenizerCodec` uses a tokenizer's
  chat template; `CharCodec` (the simulator, which has no tokenizer) uses the "role: content" lines
  of `builtin:tiny`'s template and one id per character.
- Chat mode (the prompt is chat messages and the codec has a template): the environment's tokens
  of a turn are the chat-template delta: the rendering of the history plus the new messages (with
  the generation prompt), after the ids used so far. If the ids used so far are not a prefix of
  that rendering (the model stopped without the template's end-of-turn text, or a tokenizer
  merges across the boundary), the turn counts as re-tokenization drift and the delta is the
  text the new messages add to the rendering, or failing that the new messages rendered alone.
- Text mode (a text prompt, or a tokenizer without a chat template): the conversation is the
  prompt text followed by each message's content, as is (an environment adds its own
  separators); the delta is the encoding of the new contents.
- An observation of `reset` re-renders the prompt with it (`prompt_ids`): it is part of the
  episode's prompt, not a turn.
- Size before tokenizing: a token's text holds at most `Codec.max_token_chars` characters, so
  messages of more than n x that many characters (`content_chars`) cannot fit in n tokens; the
  episode runner refuses or ends on such an observation without encoding it (encoding megabytes
  takes minutes and gigabytes). Encoding is CPU work of the caller's: a codec whose encoding can
  take long says so (`offload`), and the runner then calls it off the event loop.

Invariants: `ids` only grows, and only by `add_model` (exactly the sampled ids) or `observe`
(environment ids, loss mask 0); `generated` counts every id after the prompt.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from asyncgrpo.environments.protocol import Message
from asyncgrpo.types import Completion, Prompt


class Codec(Protocol):
    @property
    def has_template(self) -> bool: ...

    @property
    def exact(self) -> bool:
        """Whether the generator's ids are this codec's encoding of its text, so a mismatch is drift worth counting."""

    @property
    def offload(self) -> bool:
        """Whether encoding may take long enough to belong on a thread (False: cheap, or the loop must stay single-threaded)."""

    @property
    def max_token_chars(self) -> int:
        """The most characters the text of one token holds (an upper bound)."""

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        """The messages as the model reads them; `tools` (OpenAI function schemas, agents/) through the template's tool support."""

    def encode(self, text: str) -> tuple[int, ...]: ...


class TokenizerCodec:
    """A Hugging Face tokenizer's chat template and encoding (no special tokens added: a template holds its own)."""

    exact = True
    offload = True

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # Episodes encode on threads of their own (`offload`): one at a time, since a Hugging Face fast tokenizer whose
        # truncation or padding settings change under a concurrent call raises "Already borrowed".
        self._encoding = threading.Lock()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary, added tokens included: a byte-level token's string has one
        character per byte and a byte-fallback token (<0xE2>) six, so none decodes to more characters than it has."""
        return max(map(len, self._tokenizer.get_vocab()), default=1)

    @property
    def has_template(self) -> bool:
        return getattr(self._tokenizer, "chat_template", None) is not None

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        return str(self._tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] or None,
        ))

    def encode(self, text: str) -> tuple[int, ...]:
        with self._encoding:
            return tuple(self._tokenizer(text, add_special_tokens=False)["input_ids"])


class CharCodec:
    """The simulator's codec: "role: content" lines (an assistant turn ends the line itself) and one id per character.
    The scripted backend's ids are not the encoding of its text, so drift is not counted (`exact` False)."""

    has_template = True
    exact = False
    offload = False  # the simulator's loop runs on virtual time, with no threads
    max_token_chars = 1

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Mapping[str, Any]] = ()) -> str:
        text = "".join(f"tools: {t['function']['name']}\n" for t in tools) + "".join(
            f"{m['role']}: {m['content']}" + ("" if m["role"] == "assistant" else "\n") for m in messages
        )
        return text + ("assistant: " if add_generation_prompt else "")

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(4 + ord(c) % 60 for c in text)


class Conversation:
    """One episode's history (see the module docstring)."""

    def __init__(self, codec: Codec, prompt: Prompt) -> None:
        self._codec = codec
        self.chat = prompt.messages is not None and codec.has_template
        self.messages: list[Message] = [dict(m) for m in prompt.messages] if prompt.messages is not None else []
        self._prompt_text = prompt.text
        self.prompt_messages = len(self.messages)
        self.prompt_ids: tuple[int, ...] = tuple(prompt.token_ids)
        self.prompt_changed = False
        self._base = self._encoded(self.messages)  # the rendering of the prompt the relative frame starts from
        self.ids: list[int] = []  # after the prompt
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[bool] = []
        self.drift_turns = 0

    def _drifted(self) -> None:
        if self._codec.exact:
            self.drift_turns += 1

    @property
    def generated(self) -> int:
        return len(self.ids)

    @property
    def context(self) -> tuple[int, ...]:
        """The ids the model sees next: the prompt and everything after it."""
        return self.prompt_ids + tuple(self.ids)

    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.mask) if m]

    def start(self, observation: Sequence[Message]) -> None:
        """The reset observation: it joins the prompt (re-rendered with it in chat mode)."""
        if not observation:
            return
        before = self._base
        self.messages.extend(observation)
        if not self.chat:
            self._prompt_text += self._text(observation, generation_prompt=False)
        self.prompt_messages = len(self.messages)
        after = self._encoded(self.messages)
        if self.chat:
            self.prompt_ids = after  # the prompt's messages and the observation, rendered as one prompt
        elif after[: len(before)] == before:
            self.prompt_ids = self.prompt_ids + after[len(before) :]
        else:
            self._drifted()
            self.prompt_ids = self.prompt_ids + self._codec.encode(self._text(observation, generation_prompt=True))
        self.prompt_changed = True
        self._base = after

    def add_model(self, completion: Completion) -> None:
        """The model's turn, exactly as sampled."""
        self.messages.append({"role": "assistant", "content": completion.text})
        self.ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs)
        self.versions.extend(completion.versions)
        self.mask.extend([True] * len(completion.token_ids))

    def delta(self, observation: Sequence[Message]) -> tuple[int, ...]:
        """The environment's tokens for `observation` after the history (not yet added); counts drift."""
        rendered = self._relative(self.messages + list(observation), generation_prompt=True)
        if rendered is not None and rendered[: len(self.ids)] == tuple(self.ids):
            return rendered[len(self.ids) :]
        self._drifted()
        if self.chat:
            before = self._codec.render(self.messages, add_generation_prompt=False)
            after = self._codec.render(self.messages + list(observation), add_generation_prompt=True)
            if after.startswith(before):
                return self._codec.encode(after[len(before) :])
        return self._codec.encode(self._text(observation, generation_prompt=True))

    def observe(self, observation: Sequence[Message], ids: tuple[int, ...]) -> None:
        """Add the environment's messages and their tokens (from `delta`) to the history."""
        self.messages.extend(observation)
        self.ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        version = self.versions[-1] if self.versions else 0
        self.versions.extend([version] * len(ids))
        self.mask.extend([False] * len(ids))

    def record(self, observation: Sequence[Message]) -> None:
        """Messages that end the episode: kept for the reward functions, never tokenized."""
        self.messages.extend(observation)

    def check_final_drift(self) -> None:
        """The last model turn: the ids used must be a prefix of the rendering of the history."""
        if self.mask and self.mask[-1]:
            rendered = self._relative(self.messages, generation_prompt=False)
            if rendered is None or rendered[: len(self.ids)] != tuple(self.ids):
                self._drifted()

    def episode_messages(self) -> list[Message]:
        return self.messages[self.prompt_messages :]

    # ------------------------------------------------------------------ rendering

    def _text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        if self.chat:
            return self._codec.render(messages, add_generation_prompt=generation_prompt)
        return "".join(str(m.get("content", "")) for m in messages)

    def _encoded(self, messages: Sequence[Message], *, generation_prompt: bool = True) -> tuple[int, ...]:
        if self.chat:
            return self._codec.encode(self._codec.render(messages, add_generation_prompt=generation_prompt))
        return self._codec.encode(self._prompt_text + self._text(messages[self.prompt_messages :], generation_prompt=False))

    def _relative(self, messages: Sequence[Message], *, generation_prompt: bool) -> tuple[int, ...] | None:
        """The rendering of `messages` after the prompt's rendering, or None when it does not start with it."""
        full = self._encoded(messages, generation_prompt=generation_prompt)
        return full[len(self._base) :] if full[: len(self._base)] == self._base else None


def content_chars(messages: Sequence[Message]) -> int:
    """The characters of the messages' contents (a content that is not a string counted as its str())."""
    return sum(len(c) if isinstance(c := m.get("content"), str) else len(str(c)) for m in messages)


def as_row(prompt: Prompt, prompt_key: str) -> Mapping[str, Any]:
    """The prompt's row as `reset` receives it: its columns, and the prompt (text or messages) under `prompt_key`."""
    value: Any = [dict(m) for m in prompt.messages] if prompt.messages is not None else prompt.text
    return {**prompt.columns, prompt_key: value}


def transcript(messages: Sequence[Any]) -> str:
    """The episode after the prompt as "role: content" lines (samples and logs; reward functions get the messages)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
