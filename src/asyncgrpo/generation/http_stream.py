"""A streamed completion (``"stream": true``) read event by event: pure, no I/O.

Job: turn the bytes of a ``POST /v1/completions`` answer in server-sent events (vLLM's and `asyncgrpo
serve`'s shape: ``data: {chunk}`` events, each one choice with the *new* tokens' ``token_ids``,
``logprobs.token_logprobs`` and ``text``, the last one a ``finish_reason``, then ``data: [DONE]``) into
the tokens of the request's `TokenSink`, as they arrive, and at the end into one `Completion`. Why
stream: a non-streamed answer is all or nothing, and a request cancelled to be resumed (vLLM 0.32
aborts a request whose client disconnects and answers nothing) would lose every token it had generated;
streamed, it loses only those not yet received.

Answers, classified as http_client.py does (the pool classifies connection failures):

    an event ``{"error": {"message", "code"}}``        -> http_client.http_error by its code (vLLM's mid-stream error)
    a chunk that is no completion / lacks token ids   -> as http_client.read_choice
    finish_reason "abort"                              -> TransientGenerationError
    the stream ends before a finish reason             -> TransientGenerationError (the server went away)

Invariants: each token is appended to the sink exactly once, in order, with its logprob, the dispatch
version and its chunk's text, before the next chunk is read; the `Completion` holds exactly the tokens
the sink received; an event may arrive split across any number of reads (bytes are buffered up to the
end of an event, ``\\n\\n``), and a single event is bounded by `MAX_EVENT_BYTES`.
"""

from __future__ import annotations

import json
from typing import Any

from asyncgrpo.errors import GenerationError, TransientGenerationError
from asyncgrpo.generation.http_client import http_error, read_choice
from asyncgrpo.types import Completion, FinishReason, GenerationRequest, TokenSink

# One event holds the tokens generated since the previous one was sent (vLLM merges the deltas a slow reader has not
# taken): at most the request's budget, some tens of bytes per token. This bound is far above that for any budget a
# model's context allows, and keeps a server that never ends an event from growing the buffer without end.
MAX_EVENT_BYTES = 64 << 20


class CompletionStream:
    """The events of one streamed completion to `request` (dispatched at `version`), fed as bytes arrive (`feed`), each
    chunk's tokens appended to `sink`; `completion()` once the stream has ended."""

    def __init__(self, request: GenerationRequest, sink: TokenSink, *, url: str, version: int, backend: str,
                 model: str | None) -> None:
        self._request, self._sink, self._url, self._version = request, sink, url, version
        self._backend, self._model = backend, model
        self._where = f"{url} (request {request.request_id})"
        self._buffer = bytearray()
        self._start = len(sink)  # the tokens the sink held before this attempt (the retry loop empties it: 0)
        self._text: list[str] = []
        self.finish: FinishReason | None = None
        self.done = False  # `data: [DONE]` received

    def feed(self, data: bytes) -> None:
        """Read every complete event in `data` (with what earlier calls left); raise the classified error of a bad one."""
        self._buffer += data
        while (end := self._event_end()) is not None:
            event, sep = bytes(self._buffer[:end]), 4 if self._buffer[end:end + 4] == b"\r\n\r\n" else 2
            del self._buffer[:end + sep]
            self._event(event)
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise GenerationError(f"{self._where} streamed an event longer than {MAX_EVENT_BYTES} bytes without ending it: "
                                  f"not a completion stream ({bytes(self._buffer[:200])!r})", backend=self._backend)

    def completion(self) -> Completion:
        """The streamed completion, once the stream ended (raise TransientGenerationError if it ended unfinished)."""
        if self.finish is None:  # (an event cut short by the end of the stream is not read: it cannot be a whole one)
            raise TransientGenerationError(
                f"{self._where} ended the streamed completion after {len(self._sink) - self._start} tokens without a "
                f"finish reason (the server closed the stream: it stopped or restarted; a transient failure)",
                backend=self._backend)
        s = self._sink
        return Completion(token_ids=tuple(s.token_ids[self._start:]), logprobs=tuple(s.logprobs[self._start:]),
                          versions=tuple(s.versions[self._start:]), finish_reason=self.finish,
                          dispatch_version=self._version, text="".join(self._text))

    def _event_end(self) -> int | None:
        ends = [i for i in (self._buffer.find(b"\n\n"), self._buffer.find(b"\r\n\r\n")) if i >= 0]
        return min(ends) if ends else None

    def _event(self, event: bytes) -> None:
        data = b"\n".join(line[5:].strip() for line in event.replace(b"\r\n", b"\n").split(b"\n")
                          if line.startswith(b"data:"))
        if not data:
            return  # a comment or keep-alive event (": ping")
        if data == b"[DONE]":
            self.done = True
            return
        text = data.decode(errors="replace")
        try:
            body: Any = json.loads(text)
        except ValueError:
            raise GenerationError(f"{self._where} streamed an event that is not JSON: {text[:300]!r}",
                                  backend=self._backend) from None
        if isinstance(body, dict) and "error" in body:
            error = body["error"]
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise http_error(status, text, url=self._url, request=self._request, backend=self._backend, model=self._model)
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) > 1:
            raise GenerationError(f"{self._where} streamed an event that is not a completion chunk: {text[:300]!r}",
                                  backend=self._backend)
        if not choices:
            return  # vLLM's usage-only chunk (stream_options.include_usage)
        if self.finish is not None:
            raise GenerationError(f"{self._where} streamed an event after the completion's finish reason: {text[:300]!r}",
                                  backend=self._backend)
        choice = choices[0]
        ids, logprobs, finish = read_choice(choice, where=self._where, backend=self._backend, text=text)
        piece = str(choice.get("text") or "")
        self._sink.extend(ids, logprobs, (self._version,) * len(ids), piece)
        self._text.append(piece)
        self.finish = finish
