"""The one-token completion that probes a hung server back into rotation (generation/http_probes.py)."""

from __future__ import annotations

from asyncgrpo.generation.http_client import completion_payload
from asyncgrpo.generation.http_probes import HealthProbes
from asyncgrpo.generation.http_servers import PooledServer
from asyncgrpo.types import GenerationRequest, SamplingParams


def test_the_probe_is_a_plain_one_token_completion_naming_the_probed_servers_own_model():
    """The newest request may have been streamed (resume) and may name another server's LoRA adapter (a version the
    hung server never loaded: it would answer 404 and stay out of rotation for good)."""
    adapters = {"http://a": "policy-v9-run", "http://b": "policy-v7-run"}
    probes = HealthProbes(None, None, None, model_for=lambda server: adapters[server.url])  # type: ignore[arg-type]
    newest = GenerationRequest("r1", 1, (5, 6, 7), SamplingParams(max_new_tokens=12), seed=0)
    probes.last_payload = completion_payload(newest, model=adapters["http://a"], per_request_seed=False, stream=True)

    body = probes._probe_body(PooledServer(url="http://b", version=7))

    assert "stream" not in body and body["max_tokens"] == 1 and body["model"] == "policy-v7-run"
    assert body["prompt"] == [5, 6, 7] and probes.last_payload["stream"] is True  # the newest request's body is kept
