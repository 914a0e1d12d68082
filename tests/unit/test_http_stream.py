"""The streamed completion reader (generation/http_stream.py): tokens reach the sink as events arrive, in any split of
the bytes, and every answer that is not a completion is classified as the plain client classifies it."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncgrpo.errors import GenerationError, MisconfiguredBackendError, PromptRejectedError, TransientGenerationError
from asyncgrpo.generation.http_client import completion_payload
from asyncgrpo.generation.http_stream import CompletionStream
from asyncgrpo.types import GenerationRequest, SamplingParams, TokenSink

REQUEST = GenerationRequest("r1", 1, (5, 6, 7), SamplingParams(max_new_tokens=8), seed=1)


def event(ids: list[int], finish: str | None = None, text: str = "", **choice: object) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [{
        "index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
        "logprobs": {"token_logprobs": [-0.5 - i for i in ids], "tokens": [str(i) for i in ids]}, **choice}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def reader(sink: TokenSink | None = None) -> CompletionStream:
    return CompletionStream(REQUEST, sink if sink is not None else TokenSink(), url="http://s", version=3, backend="http",
                            model="m")


STREAM = (b": keep-alive\n\n" + event([11, 12], text="ab", prompt_token_ids=[5, 6, 7]) + event([13], text="c")
          + event([14], "length", text="d") + b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\n'
          + b"data: [DONE]\n\n")


@pytest.mark.parametrize("cut", [1, 7, 64, len(STREAM)])
def test_every_token_reaches_the_sink_once_in_order_whatever_the_reads(cut: int) -> None:
    sink = TokenSink()
    stream = reader(sink)
    for start in range(0, len(STREAM), cut):
        stream.feed(STREAM[start:start + cut])
    completion = stream.completion()
    assert completion.token_ids == (11, 12, 13, 14) and completion.finish_reason == "length"
    assert completion.logprobs == (-11.5, -12.5, -13.5, -14.5) and completion.versions == (3,) * 4
    assert completion.text == "abcd" and completion.dispatch_version == 3 and stream.done
    assert (sink.token_ids, sink.logprobs, sink.versions, "".join(sink.text)) == (
        list(completion.token_ids), list(completion.logprobs), list(completion.versions), "abcd")


def test_the_sink_holds_each_chunk_before_the_stream_ends() -> None:
    sink = TokenSink()
    stream = reader(sink)
    stream.feed(event([11, 12], text="ab") + event([13])[:20])  # the second event is not complete yet
    assert sink.token_ids == [11, 12] and sink.versions == [3, 3] and sink.text == ["ab"]
    with pytest.raises(TransientGenerationError, match="without a finish reason"):
        stream.completion()  # the connection closed here: what was received stays in the sink
    assert sink.token_ids == [11, 12]


def test_crlf_events() -> None:
    stream = reader()
    stream.feed(event([11]).replace(b"\n\n", b"\r\n\r\n") + event([12], "stop").replace(b"\n\n", b"\r\n\r\n"))
    assert stream.completion().token_ids == (11, 12)


@pytest.mark.parametrize(("body", "error", "match"), [
    (b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n', TransientGenerationError, "boom"),
    (b'data: {"error": {"message": "This model\'s maximum context length is 9 tokens", "code": 400}}\n\n', PromptRejectedError,
     "maximum context length"),
    (event([11], "abort"), TransientGenerationError, "aborted"),
    (event([11], "length", token_ids=None), MisconfiguredBackendError, "token_ids"),
    (event([11], "length", logprobs=None), MisconfiguredBackendError, "token_logprobs"),
    (event([11], "error"), GenerationError, "finish_reason 'error'"),
    (b"data: {not json\n\n", GenerationError, "not JSON"),
    (b'data: {"object": "x"}\n\n', GenerationError, "not a completion chunk"),
    (event([11], "stop") + event([12]), GenerationError, "after the completion's finish reason"),
])
def test_answers_that_are_not_a_completion_are_classified(body: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        reader().feed(body)


def test_only_a_request_with_a_sink_is_streamed() -> None:
    assert completion_payload(REQUEST, model="m", per_request_seed=False, stream=True)["stream"] is True
    assert "stream" not in completion_payload(REQUEST, model="m", per_request_seed=False)


def test_a_resumed_request_whose_budget_is_spent_is_answered_without_a_server() -> None:
    from asyncgrpo.config import validate_config
    from asyncgrpo.generation.http import HttpGenerator
    from asyncgrpo.rollout.resume import resumed_request
    from asyncgrpo.types import Completion

    cfg = validate_config({"generation": {"backend": "http", "http": {"base_urls": ["http://127.0.0.1:1"]}}}, "test")
    gen = HttpGenerator(cfg.generation)  # never started: no server is asked
    spent = Completion((9,) * 8, (-1.0,) * 8, (0,) * 8, "length", 0)
    empty = asyncio.run(gen.generate(resumed_request(REQUEST, spent, TokenSink())))
    assert empty.token_ids == () and empty.finish_reason == "length" and gen.stats()["servers"][0]["dispatched"] == 0
