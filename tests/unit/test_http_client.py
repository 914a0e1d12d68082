"""read_completion: which answers are completions, and the per-token checks of token_ids and logprobs."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.errors import MisconfiguredBackendError
from asyncgrpo.generation.http_client import read_completion
from asyncgrpo.types import GenerationRequest, SamplingParams

REQUEST = GenerationRequest(request_id="r", prompt_id=0, prompt_token_ids=(1,), sampling=SamplingParams(max_new_tokens=4), seed=0)


def answer(token_ids, logprobs) -> str:
    return json.dumps({"choices": [{"text": "ab", "token_ids": token_ids, "finish_reason": "stop",
                                    "logprobs": {"token_logprobs": logprobs}}]})


def read(text: str):
    return read_completion(200, text, url="http://s", request=REQUEST, version=3, backend="http", model="m")


def test_a_completion_keeps_its_tokens_and_makes_logprobs_floats():
    c = read(answer([7, 8], [-1, -0.5]))
    assert c.token_ids == (7, 8) and c.logprobs == (-1.0, -0.5) and all(type(x) is float for x in c.logprobs)
    assert c.versions == (3, 3) and c.dispatch_version == 3 and c.text == "ab"


@pytest.mark.parametrize("token_ids", [[7, "8"], [7, 8.0], [None, 8], "78", None])
def test_token_ids_that_are_not_all_integers_are_a_misconfigured_server(token_ids):
    with pytest.raises(MisconfiguredBackendError, match="token_ids"):
        read(answer(token_ids, [-1.0, -1.0]))


@pytest.mark.parametrize("logprobs", [[-1.0, float("nan")], [-1.0, True], [-1.0, "x"], [-1.0, None], [-1.0], None])
def test_logprobs_that_are_not_one_number_per_token_are_a_misconfigured_server(logprobs):
    with pytest.raises(MisconfiguredBackendError, match="logprobs"):
        read(answer([7, 8], logprobs))
