"""`rollout.on_stale: resume` over HTTP against three real `asyncgrpo serve` processes.

A greedy rollout is interrupted twice, its first server killed after the first interruption, and the server of its
last resumption killed while it streams. Each resumption goes to a server alive at the time, and the rollout's ids,
logprobs and text equal those of the same request never interrupted: nothing lost or repeated at any seam (a token
repeated inside a run of equal tokens would leave the ids alike, but not the logprobs, which depend on the position).
The interruptions are exact: the server is stopped (SIGSTOP) before the client cancels, so the prefix is every token
received by then.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from asyncgrpo.generation.http import HttpGenerator
from asyncgrpo.generation.serve_stream import StreamedTokens
from asyncgrpo.models.saving import save_model
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.rollout.resume import join, partial, resumed_request
from asyncgrpo.rollout.retry import generate_with_retries
from asyncgrpo.types import Completion, GenerationRequest, SamplingParams
from tests.integration.servers import ServeProcess
from tests.integration.test_http_generator import recipe, run

pytestmark = pytest.mark.timeout(180)

BUDGET = 120
REQUEST = GenerationRequest("resumed", 0, (5, 6, 7), SamplingParams(max_new_tokens=BUDGET, temperature=0.0,
                                                                     repetition_penalty=50.0, stop_token_ids=(2,)), seed=0)


@pytest.fixture
def three_servers(tmp_path):
    model = save_model(*build_tiny(0), tmp_path / "tiny")
    servers = [ServeProcess(model, tmp_path, extra=("--served-model-name", "tiny")).start() for _ in range(3)]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.kill()


def holding(gen: HttpGenerator, servers: list[ServeProcess]) -> ServeProcess:
    """The server our one request in flight is on."""
    [url] = [s["url"] for s in gen.stats()["servers"] if s["outstanding"]]
    return next(s for s in servers if s.url == url)


async def interrupt(gen: HttpGenerator, servers: list[ServeProcess], request: GenerationRequest, *, after: int,
                    kill: bool) -> Completion:
    """Send `request` (with retries, as the collector does), and once `after` tokens are received stop its server and
    cancel it; the tokens received, as the collector's prefix. `kill`: the server is then killed, else it continues."""
    sink = request.sink
    assert isinstance(sink, StreamedTokens)
    task = asyncio.ensure_future(attempts(gen, request))
    task.add_done_callback(lambda _: sink.signal.notify())
    await sink.signal.wait_for(lambda: len(sink) >= after or task.done())
    assert not task.done(), "the request finished before it could be interrupted"
    server = holding(gen, servers)
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if kill:
        server.kill()
    else:
        os.kill(server.proc.pid, signal.SIGCONT)
    return partial(sink, 0)


def attempts(gen: HttpGenerator, request: GenerationRequest):
    """The collector's attempts of one request: the sink holds the current attempt's tokens only."""
    assert request.sink is not None
    sink = request.sink
    sink.empty()  # the tokens of the attempt interrupted before are the request's prefix now
    return generate_with_retries(gen, request, gen.cfg, jitter=random.Random(0), before_attempt=sink.empty)


def test_a_rollout_resumes_across_interruptions_and_dead_servers_without_losing_or_repeating_a_token(three_servers):
    servers = three_servers
    cfg = recipe([s.url for s in servers]).generation

    async def main():
        gen = HttpGenerator(cfg)
        await gen.start()
        try:
            reference = await gen.generate(REQUEST)  # not streamed: no sink
            assert len(reference.token_ids) == BUDGET and len(set(zip(reference.token_ids, reference.token_ids[1:]))) > 10

            sink = StreamedTokens()
            prefix = await interrupt(gen, servers, resumed_request(REQUEST, None, sink), after=15, kill=True)
            # The first resumption goes to a server alive (the dead one refuses: the retry goes on), and is interrupted.
            prefix = join(prefix, await interrupt(gen, servers, resumed_request(REQUEST, prefix, sink), after=15, kill=False))
            assert 30 <= len(prefix.token_ids) < BUDGET

            # The second resumption's server is killed while it streams: its tokens are no prefix, the retry goes on to
            # the last server alive and starts over from the same prefix.
            request = resumed_request(REQUEST, prefix, sink)
            task = asyncio.ensure_future(attempts(gen, request))
            task.add_done_callback(lambda _: sink.signal.notify())
            await sink.signal.wait_for(lambda: len(sink) >= 10 or task.done())
            assert not task.done()
            holding(gen, servers).kill()
            continuation = await task
            assert request.prompt_token_ids == REQUEST.prompt_token_ids + prefix.token_ids
            assert request.sampling.max_new_tokens == BUDGET - len(prefix.token_ids)
            return reference, join(prefix, continuation)
        finally:
            await gen.aclose()

    reference, resumed = run(main(), timeout_s=150)
    assert resumed.token_ids == reference.token_ids
    assert resumed.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert resumed.text == reference.text and resumed.versions == (0,) * BUDGET and resumed.finish_reason == "length"
