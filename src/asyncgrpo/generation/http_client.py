"""The completion client of the OpenAI-compatible HTTP dialect (vLLM, `asyncgrpo serve`): pure, no I/O.

Job: build the body of one ``POST /v1/completions`` for a `GenerationRequest`, read a server's
answer back into a `Completion`, and classify every answer that is not one into errors.py's
classes. The server pool (generation/http.py) sends the request and owns the connections;
generation/serve.py is the server half of the same dialect.

Wire format, per request (what vLLM >= 0.10.2 and `asyncgrpo serve` accept)::

    {"model": M, "prompt": [ids], "max_tokens": N, "temperature": T, "top_p": P, "n": 1,
     "logprobs": 0, "return_token_ids": true, "stop_token_ids": [ids]}   (+ "seed": S with http.seed per_request)
    (+ "top_k", "min_p", "repetition_penalty" when they are not off)

read back: ``choices[0].token_ids``, ``choices[0].logprobs.token_logprobs``, ``choices[0].text``,
``choices[0].finish_reason``. With ``"stream": true`` (a request whose tokens must survive an interruption,
`rollout.on_stale: resume`) the answer is server-sent events, one such choice per event holding the new
tokens only (generation/http_stream.py reads them). For logprobs of the distribution actually sampled, start vLLM with
``--logprobs-mode processed_logprobs`` (its default returns the raw model's logprobs, before
temperature, penalty and truncation): vLLM then returns log q renormalised over the support its
min-p / top-k / top-p kept, in sampling.py's order, which is what the trainer scores.

Answers, classified (connection failures and timeouts are the pool's, see generation/http.py):

    HTTP 408, 429, 5xx; finish_reason "abort"           -> TransientGenerationError
    HTTP 413; HTTP 400 saying the prompt is too long    -> PromptRejectedError
    HTTP 401, 403, 404, 422; a 200 without token_ids    -> MisconfiguredBackendError (fatal, server's message)
    any other 4xx; a 200 that is not a completion       -> GenerationError (the rollout fails, not retried)

A completion's `versions` are all `version`, the server's version when the request was dispatched.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, cast

from asyncgrpo.errors import GenerationError, MisconfiguredBackendError, PromptRejectedError, TransientGenerationError
from asyncgrpo.types import Completion, FinishReason, GenerationRequest

# vLLM: "This model's maximum context length is N tokens. However, your prompt contains M input tokens...",
# "The decoder prompt (length N) is longer than the maximum model length of M"; others: "prompt is too long",
# "context length exceeded". Not "max_tokens=N cannot be greater than max_model_len" (a setting, not the prompt).
_JSON_INTS = frozenset({int, bool})  # what isinstance(x, int) accepts among the types json.loads makes
_JSON_NUMBERS = frozenset({int, float})  # numbers, not bools
PROMPT_TOO_LONG = re.compile(
    r"maximum context length|maximum model length|longer than the maximum|prompt.{0,40}too long|too long.{0,40}prompt"
    r"|input.{0,40}too long|context length exceeded|context_length_exceeded", re.I)


def server_message(text: str) -> str:
    """The human message of an error body: vLLM's {"error": {"message"}}, {"message"}, FastAPI's {"detail"}, or the text."""
    try:
        body = json.loads(text)
    except (ValueError, TypeError):
        return text.strip()[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if body.get(key):
                value = body[key]
                return value if isinstance(value, str) else json.dumps(value)[:500]
    return text.strip()[:500]


def completion_payload(request: GenerationRequest, *, model: str | None, per_request_seed: bool,
                       stream: bool = False) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for `request` (the wire format above; `stream`: answered as server-sent
    events, generation/http_stream.py)."""
    s = request.sampling
    payload: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": list(s.stop_token_ids),
    }
    if s.top_k > 0:
        payload["top_k"] = s.top_k
    if s.min_p > 0:
        payload["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        payload["repetition_penalty"] = s.repetition_penalty
    if per_request_seed:
        payload["seed"] = request.seed
    if stream:
        payload["stream"] = True
    return payload


def read_completion(status: int, text: str, *, url: str, request: GenerationRequest, version: int, backend: str,
                    model: str | None) -> Completion:
    """The `Completion` in a server's answer to `request` (dispatched at `version`), or the classified error."""
    if status != 200:
        raise http_error(status, text, url=url, request=request, backend=backend, model=model)
    where = f"{url} (request {request.request_id})"
    try:
        choice = json.loads(text)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise GenerationError(f"{where} answered 200 with a body that is not a completion: {text[:300]!r}",
                              backend=backend) from None
    token_ids, logprobs, finish = read_choice(choice, where=where, backend=backend, text=text)
    if finish is None:
        raise GenerationError(f"{where} finished with finish_reason None; expected 'stop' or 'length'.", backend=backend)
    return Completion(
        token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        versions=(version,) * len(token_ids),
        finish_reason=finish,
        dispatch_version=version,
        text=str(choice.get("text") or ""),
    )


def read_choice(choice: Any, *, where: str, backend: str, text: str) -> tuple[list[int], list[float], FinishReason | None]:
    """A completion choice's token ids, their logprobs and its finish reason (None: a streamed chunk of a completion still
    running), or the classified error. `text`: the answer (or the streamed event) it is from, quoted in errors."""
    if not isinstance(choice, dict):
        raise GenerationError(f"{where} answered 200 with a body that is not a completion: {text[:300]!r}",
                              backend=backend)
    finish = choice.get("finish_reason")
    if finish == "abort":
        raise TransientGenerationError(f"{where} aborted the request (finish_reason 'abort': the server was paused "
                                       f"with mode=abort, or is shutting down)", backend=backend)
    token_ids = choice.get("token_ids")
    # Per-token checks by type sets and map (C loops): a Python-level generator per token was a tenth of the client's CPU.
    if not isinstance(token_ids, list) or not set(map(type, token_ids)) <= _JSON_INTS:
        raise MisconfiguredBackendError(
            f"{where} returned no choices[0].token_ids: the server must support return_token_ids "
            f"(vLLM >= 0.10.2, or asyncgrpo serve).", backend=backend)
    logprobs = choice["logprobs"].get("token_logprobs") if isinstance(choice.get("logprobs"), dict) else None
    if not token_ids and logprobs is None:
        logprobs = []  # a streamed chunk without tokens (vLLM's last one may carry only the finish reason)
    if (not isinstance(logprobs, list) or len(logprobs) != len(token_ids)
            or not set(map(type, logprobs)) <= _JSON_NUMBERS or any(map(math.isnan, logprobs))):
        raise MisconfiguredBackendError(
            f"{where} returned no usable choices[0].logprobs.token_logprobs ({len(token_ids)} tokens, logprobs "
            f"{str(logprobs)[:120]}): the server must return the sampled tokens' logprobs for logprobs=0.",
            backend=backend)
    if finish not in ("stop", "length", None):
        raise GenerationError(f"{where} finished with finish_reason {finish!r}; expected 'stop' or 'length'.",
                              backend=backend)
    return token_ids, list(map(float, logprobs)), cast("FinishReason | None", finish)


def http_error(status: int, text: str, *, url: str, request: GenerationRequest, backend: str,
               model: str | None) -> GenerationError:
    """The error class of a non-200 answer to `request` (module docstring's table)."""
    message = server_message(text)
    what = f"{url} answered HTTP {status} to request {request.request_id}: {message}"
    if status in (408, 429) or status >= 500:
        return TransientGenerationError(what, backend=backend)
    if status == 413 or (status == 400 and PROMPT_TOO_LONG.search(message)):
        return PromptRejectedError(f"{what}. The prompt ({len(request.prompt_token_ids)} tokens) plus max_new_tokens "
                                   f"({request.sampling.max_new_tokens}) does not fit the server's model.",
                                   backend=backend)
    if status in (401, 403):
        return MisconfiguredBackendError(f"{what}. Fix: check generation.http.api_key.", backend=backend)
    if status == 404:
        return MisconfiguredBackendError(f"{what}. Fix: check generation.http.model ({model!r}) and the URL.",
                                         backend=backend)
    if status == 422:
        return MisconfiguredBackendError(f"{what}. The server rejects a request field asyncgrpo sends: check its "
                                         f"version (vLLM >= 0.10.2).", backend=backend)
    return GenerationError(what, backend=backend)
