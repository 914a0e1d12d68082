"""`asyncgrpo serve`'s streamed answer (``"stream": true``): vLLM's server-sent events for one completion request.

Job: while the engine generates a request, send each decoding step's new tokens as one chunk (serve_protocol.py
`chunk_body`: ids, logprobs, text), the finish reason on the last one, then ``data: [DONE]``. The engine appends
each step's tokens to the request's `StreamedTokens` sink (generation/local.py), which wakes the writer.

Invariants:
- Every token the engine generated for the request is sent exactly once, in order, before the finish reason.
- Errors before the first token keep their HTTP status (the caller answers them, as for a plain request);
  once the stream has begun, an engine failure is one ``data: {"error": ...}`` event and an abort
  (``/pause?mode=abort``) a last chunk with ``finish_reason: "abort"``, as vLLM's.
- Text: each chunk holds the text its tokens complete (a character split across tokens waits for its last
  token; a stop token's text is never sent); the last chunk completes it to the text of a plain answer.
- Waits: the writer waits for new tokens or the engine call's end (no other deadline: a client that leaves
  cancels the handler, which cancels the engine call).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from asyncgrpo.errors import GenerationError
from asyncgrpo.generation.serve_protocol import ServedModel, chunk_body
from asyncgrpo.sync import StateSignal
from asyncgrpo.types import Completion, GenerationRequest, TokenSink


class StreamedTokens(TokenSink):
    """A `TokenSink` that wakes its reader (`signal`) whenever the engine appends tokens."""

    __slots__ = ("signal",)

    def __init__(self) -> None:
        super().__init__()
        self.signal = StateSignal()

    def extend(self, token_ids: Any, logprobs: Any, versions: Any, text: str = "") -> None:
        super().extend(token_ids, logprobs, versions, text)
        self.signal.notify()


class TextDeltas:
    """The text a growing token list completes, chunk by chunk (vLLM's incremental detokenisation: decode a short window
    before the new tokens and keep what the new tokens add; a text ending in an unfinished character waits)."""

    def __init__(self, tokenizer: Any, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer, self._stops = tokenizer, stop_token_ids
        self._prefix = self._read = 0  # token offsets: the window's start, and the end of the text already sent
        self.sent: list[str] = []

    def delta(self, ids: list[int]) -> str:
        """The text of the tokens after those already sent (a stop token at the end excluded)."""
        if self._tokenizer is None:
            return ""
        end = len(ids) - 1 if ids and ids[-1] in self._stops else len(ids)
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:end])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, end
        return self._keep(after[len(before):])

    def rest(self, full_text: str) -> str:
        """The last chunk's text: what of the plain answer's `full_text` was not sent (nothing if what was sent is not its
        beginning: a tokenizer that decodes a window differently from the whole text)."""
        sent = "".join(self.sent)
        return self._keep(full_text[len(sent):] if full_text.startswith(sent) else "")

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _keep(self, text: str) -> str:
        self.sent.append(text)
        return text


async def stream_answer(state: ServedModel, http_request: web.Request, request: GenerationRequest,
                        task: asyncio.Future[Completion], want_ids: bool, want_logprobs: bool) -> web.StreamResponse | None:
    """Stream `task`'s tokens (the engine call of `request`, whose sink is a `StreamedTokens`) as vLLM's events. Returns
    None, sending nothing, when the call ended before its first token by failing or being aborted: the caller answers
    that as a plain request's (its HTTP status, or the abort body); the call's own exception is not raised here."""
    sink = request.sink
    assert isinstance(sink, StreamedTokens)
    task.add_done_callback(lambda _: sink.signal.notify())
    await sink.signal.wait_for(lambda: len(sink) > 0 or task.done())
    if not len(sink) and (task.cancelled() or task.exception() is not None):
        return None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http_request)
    text, sent, first = TextDeltas(state.tokenizer, request.sampling.stop_token_ids), 0, True

    async def send(body: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(body)}\n\n".encode())

    async def chunk(end: int, piece: str, finish: str | None) -> None:
        nonlocal sent, first
        await send(chunk_body(state, request, sink.token_ids[sent:end], sink.logprobs[sent:end], piece, finish, first=first,
                              want_ids=want_ids, want_logprobs=want_logprobs))
        sent, first = end, False

    while not task.done():
        if len(sink) > sent:
            end = len(sink)
            await chunk(end, text.delta(sink.token_ids[:end]), None)
        await sink.signal.wait_for(lambda: len(sink) > sent or task.done())
    if task.cancelled():  # /pause?mode=abort
        await chunk(len(sink), "", "abort")
    elif (error := task.exception()) is not None:
        status = 500 if not isinstance(error, GenerationError) else 503
        await send({"error": {"message": str(error), "type": "InternalServerError", "param": None, "code": status}})
    else:
        completion = task.result()
        await chunk(len(sink), text.rest(completion.text), completion.finish_reason)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
