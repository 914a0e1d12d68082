"""The subset of vLLM's HTTP protocol that `asyncgrpo serve` speaks (serve.py), in vLLM's shapes.

Job: validate a ``POST /v1/completions`` body into a `GenerationRequest` (`parse_completion`), write the
answer's body for a completed or an aborted request (`completion_body`, `abort_body`) or one streamed chunk
of it (`chunk_body`), and vLLM's error body (`error_response`). No I/O and no state: what it needs of the server is the `ServedModel` it is given.

Invariants:
- A body is accepted only when every field is one this server implements (`SUPPORTED`), one it ignores
  as vLLM does (`IGNORED`), or one it does not implement sent at its neutral value (`NEUTRAL`); any other
  field or value is a `BadRequest` naming the field (422): silently ignoring a sampling setting would
  change results.
- Every refused body is a `BadRequest` with vLLM's status and wording (400 malformed or too long for the
  model, 404 unknown model, 422 unsupported); a request that passes fits the model's context
  (prompt tokens + max_tokens <= max_model_len) and its token ids are in the vocabulary.
- ``"stream": true`` answers in server-sent events of `chunk_body` (serve_stream.py), as vLLM does.
- Without ``ignore_eos`` the tokenizer's end-of-sequence token stops generation, as vLLM's does; a request
  without ``seed`` gets a random one (the engine is seeded per request).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Collection
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from asyncgrpo.types import GenerationRequest, SamplingParams


class ServedModel(Protocol):
    """What the protocol needs to know of the model being served (serve.py's `ServerState` is one)."""

    model_name: str
    @property
    def adapter_names(self) -> Collection[str]: ...  # LoRA adapters a request may name as its model too

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    tokenizer: Any


# Fields a client may send only at these neutral values (what vLLM would do by default).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "best_of": (1, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,),
    "suffix": (None,),
    "stop": (None,),
    "skip_special_tokens": (True, None),
    "include_stop_str_in_output": (False, None),
    "min_tokens": (0, None),
    "stream_options": (None,),
}
IGNORED = ("user", "request_id", "priority")
SUPPORTED = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
              "logprobs", "return_token_ids", "stop_token_ids", "ignore_eos", "n", "stream")


class BadRequest(Exception):
    """A request this server refuses: the HTTP `status`, the message, and the offending field (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
                422: "UnprocessableEntityError", 500: "InternalServerError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return web.json_response(body, status=status)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


class ParsedCompletion(NamedTuple):
    """A valid completion body: the request, and whether the answer holds token ids and logprobs and is streamed."""

    request: GenerationRequest
    want_ids: bool
    want_logprobs: bool
    stream: bool


def parse_completion(state: ServedModel, body: dict[str, Any], prompt_ids: list[int] | None = None) -> ParsedCompletion:
    """Validate a /v1/completions body like vLLM does (the subset we serve); raise BadRequest. `prompt_ids`:
    the string prompt's tokens (serve.py tokenizes them off the event loop)."""
    for key, value in body.items():
        if key in SUPPORTED or key in IGNORED:
            continue
        if key in NEUTRAL:
            if value not in NEUTRAL[key]:
                raise BadRequest(422, f"{key}={value!r} is not supported by asyncgrpo serve (only {NEUTRAL[key][0]!r})", key)
            continue
        raise BadRequest(422, f"unsupported field {key!r}; asyncgrpo serve supports {', '.join(SUPPORTED)}", key)

    model = body.get("model")
    if model is not None and model != state.model_name and model not in state.adapter_names:
        raise BadRequest(404, f"The model `{model}` does not exist.", "model")

    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "The prompt cannot be empty", "prompt")
        prompt_ids = list(prompt_ids or ())
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompt_ids = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise BadRequest(400, "The prompt cannot be empty", "prompt")
    else:
        raise BadRequest(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not prompt_ids:
        raise BadRequest(400, "The prompt cannot be empty", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise BadRequest(400, f"Token id {bad[0]} is out of vocabulary (vocab size {state.vocab_size})", "prompt")

    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise BadRequest(400, f"n={n!r} is not supported by asyncgrpo serve: send one request per completion (n=1)", "n")

    max_len = state.max_model_len
    if len(prompt_ids) > max_len:
        raise BadRequest(400, f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length of "
                               f"{max_len}. Make sure that `max_model_len` is no smaller than the number of text tokens.", "prompt")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = max_len - len(prompt_ids)
        if max_tokens < 1:
            raise BadRequest(400, f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum model length of "
                                   f"{max_len - 1} (one token must be left to generate).", "prompt")
    elif not is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if len(prompt_ids) + max_tokens > max_len:
        raise BadRequest(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                               f"{max_tokens} output tokens and your prompt contains {len(prompt_ids)} input tokens, for a "
                               f"total of {len(prompt_ids) + max_tokens} tokens. Please reduce the length of the input "
                               f"prompt or the number of requested output tokens.", "prompt")

    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not is_number(temperature) or temperature < 0:
        raise BadRequest(400, f"temperature must be a number >= 0, got {temperature!r}", "temperature")
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise BadRequest(400, f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if not is_int(top_k) or top_k < 0:
        raise BadRequest(400, f"top_k must be -1 or 0 (off) or a positive integer, got {top_k!r}", "top_k")
    min_p = body.get("min_p")
    min_p = 0.0 if min_p is None else min_p
    if not is_number(min_p) or not 0 <= min_p <= 1:
        raise BadRequest(400, f"min_p must be in [0, 1], got {min_p!r}", "min_p")
    penalty = body.get("repetition_penalty")
    penalty = 1.0 if penalty is None else penalty
    if not is_number(penalty) or penalty <= 0:
        raise BadRequest(400, f"repetition_penalty must be a number > 0, got {penalty!r}", "repetition_penalty")
    seed = body.get("seed")
    if seed is None:
        seed = random.getrandbits(63)
    elif not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise BadRequest(400, f"seed must be a 64-bit integer, got {seed!r}", "seed")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise BadRequest(400, f"logprobs must be an integer >= 0, got {logprobs!r}", "logprobs")
    if logprobs is not None and logprobs > 0:
        raise BadRequest(422, "asyncgrpo serve returns only the sampled tokens' logprobs: send logprobs=0", "logprobs")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids):
        raise BadRequest(400, f"stop_token_ids must be a list of token ids, got {stop_ids!r}", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(400, f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool) and return_ids is not None:
        raise BadRequest(400, f"return_token_ids must be a boolean, got {return_ids!r}", "return_token_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest(400, f"stream must be a boolean, got {stream!r}", "stream")
    stops = list(stop_ids)
    if not ignore_eos and state.eos_token_id is not None:
        stops.append(state.eos_token_id)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                              stop_token_ids=tuple(dict.fromkeys(stops)), top_k=top_k, min_p=float(min_p),
                              repetition_penalty=float(penalty))
    request = GenerationRequest(request_id=f"cmpl-{uuid.uuid4().hex}", prompt_id=-1, prompt_token_ids=tuple(prompt_ids),
                                sampling=sampling, seed=seed & 0x7FFF_FFFF_FFFF_FFFF)
    return ParsedCompletion(request, bool(return_ids), logprobs is not None, bool(stream))


def completion_body(state: ServedModel, request: GenerationRequest, completion: Any, want_ids: bool, want_logprobs: bool) -> dict[str, Any]:
    """vLLM's answer to a completed request: the text, finish and stop reasons, and (asked for) logprobs and token ids."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": completion.text,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.token_ids[-1] if completion.finish_reason == "stop" and completion.token_ids else None,
    }
    if want_logprobs:
        tokens = state.tokenizer.convert_ids_to_tokens(list(completion.token_ids)) if state.tokenizer is not None else [
            str(t) for t in completion.token_ids]
        choice["logprobs"] = {
            "text_offset": [],
            "token_logprobs": list(completion.logprobs),
            "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, completion.logprobs)],
        }
    if want_ids:
        choice["prompt_token_ids"] = list(request.prompt_token_ids)
        choice["token_ids"] = list(completion.token_ids)
    prompt_tokens, completion_tokens = len(request.prompt_token_ids), len(completion.token_ids)
    return {
        "id": request.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def chunk_body(state: ServedModel, request: GenerationRequest, token_ids: list[int], logprobs: list[float], text: str,
               finish_reason: str | None, *, first: bool, want_ids: bool, want_logprobs: bool) -> dict[str, Any]:
    """vLLM's streamed chunk (``"stream": true``): the tokens generated since the previous chunk, their logprobs and text
    (asked for), the prompt's token ids on the first chunk, and the finish reason on the last."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                              "stop_reason": token_ids[-1] if finish_reason == "stop" and token_ids else None}
    if want_logprobs:
        tokens = state.tokenizer.convert_ids_to_tokens(token_ids) if state.tokenizer is not None else [str(t) for t in token_ids]
        choice["logprobs"] = {"text_offset": [], "token_logprobs": logprobs, "tokens": tokens,
                              "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs)]}
    if want_ids:
        choice["prompt_token_ids"] = list(request.prompt_token_ids) if first else None
        choice["token_ids"] = token_ids
    return {"id": request.request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": [choice]}


def abort_body(state: ServedModel, request: GenerationRequest) -> dict[str, Any]:
    """vLLM's answer to a request aborted by ``/pause?mode=abort``: no text, ``finish_reason: "abort"``."""
    prompt_tokens = len(request.prompt_token_ids)
    return {
        "id": request.request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort", "stop_reason": None, "token_ids": []}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens},
    }
