"""The in-process engine against builtin:tiny: logprobs, stopping, seeds, cancellation, weight swaps, close, failure.

Synchronisation is deterministic: a `Gate` step hook parks the engine thread at a chosen
decoding step until the test releases it; no test sleeps to wait for something.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from asyncgrpo.errors import GenerationError, PromptRejectedError, TransientGenerationError
from asyncgrpo.generation.base import Generator
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.types import GenerationRequest, SamplingParams
from tests.bounded import run_bounded

PROMPTS = ["what is 2+2?", "1+1=", "hello, tiny model. how are you today?", "x"]


def run(coro, timeout_s: float = 60.0):
    return run_bounded(coro, timeout_s)


def request(rid: int, prompt: str, tokenizer, *, seed: int | None = None, **sampling) -> GenerationRequest:
    sampling.setdefault("max_new_tokens", 12)
    ids = tuple(tokenizer(prompt)["input_ids"])
    return GenerationRequest(f"r{rid}", rid, ids, SamplingParams(**sampling), seed=rid if seed is None else seed)


def teacher_forced(model, req: GenerationRequest, token_ids) -> torch.Tensor:
    """log q(token_t | prompt, tokens_<t) by one plain forward and transformers' own processors, in vLLM's order
    (repetition penalty, temperature, min-p, top-k, top-p; greedy: the penalty only, at T = 1)."""
    s = req.sampling
    chain = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty=s.repetition_penalty))
    if s.temperature > 0:
        chain.append(TemperatureLogitsWarper(s.temperature))
        if s.min_p > 0:
            chain.append(MinPLogitsWarper(min_p=s.min_p))
        if s.top_k > 0:
            chain.append(TopKLogitsWarper(top_k=s.top_k))
        if s.top_p < 1:
            chain.append(TopPLogitsWarper(top_p=s.top_p))
    ids = list(req.prompt_token_ids) + list(token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    p = len(req.prompt_token_ids)
    out = []
    for t, token in enumerate(token_ids):
        scores = chain(torch.tensor([ids[: p + t]]), logits[p - 1 + t][None].clone())
        out.append(torch.log_softmax(scores, dim=-1)[0, token])
    return torch.stack(out)


class Gate:
    """Step hook: parks the engine thread after the given global step numbers until `open(step)`."""

    def __init__(self, *steps: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.reached = {s: asyncio.Event() for s in steps}
        self.released = {s: threading.Event() for s in steps}

    def __call__(self, stats: dict[str, int]) -> None:
        step = stats["steps"]
        if step in self.reached:
            self.loop.call_soon_threadsafe(self.reached[step].set)
            if not self.released[step].wait(timeout=20):
                raise RuntimeError(f"test never released step {step}")

    async def wait(self, step: int) -> None:
        await self.reached[step].wait()

    def open(self, step: int) -> None:
        self.released[step].set()


async def enqueue(engine: LocalEngine, requests) -> list[asyncio.Task]:
    """Start one task per request and let each reach the engine queue (one loop turn, then checked)."""
    before = engine.stats()["queued"]
    tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
    await asyncio.sleep(0)  # each new task runs up to its await, i.e. enqueues; this is not a timing wait
    assert engine.stats()["queued"] == before + len(tasks)
    return tasks


async def park_on_blocker(engine: LocalEngine, gate: Gate, tokenizer) -> asyncio.Task:
    """Run a 1-token request whose step 1 the gate holds, so the test's next requests form one wave."""
    blocker = asyncio.create_task(engine.generate(request(999, "x", tokenizer, max_new_tokens=1)))
    await gate.wait(1)
    return blocker


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncgrpo-engine")]


def test_engine_satisfies_generator_protocol():
    model, tokenizer = build_tiny(0)
    assert isinstance(LocalEngine(model, tokenizer), Generator)


def test_logprobs_match_teacher_forcing_across_padding_temperatures_and_truncation():
    model, tokenizer = build_tiny(0)
    reference, _ = build_tiny(0)
    settings = [dict(temperature=1.0, top_k=20), dict(temperature=0.7, min_p=0.1),
                dict(temperature=1.3, top_p=0.8, repetition_penalty=1.3), dict(temperature=0.0, repetition_penalty=1.2),
                dict(temperature=1.0, top_p=0.9, top_k=12, min_p=0.05)]
    requests = [request(i, p, tokenizer, **s) for i, (p, s) in enumerate(zip(PROMPTS, settings))]

    async def main():
        gate = Gate(1)
        engine = LocalEngine(model, tokenizer, max_batch_size=8, step_hook=gate)
        await engine.start()
        try:
            blocker = await park_on_blocker(engine, gate, tokenizer)
            tasks = await enqueue(engine, requests)
            gate.open(1)
            await blocker
            return await asyncio.gather(*tasks), engine.stats()
        finally:
            gate.open(1)
            await engine.aclose()

    completions, stats = run(main())
    assert stats["waves"] == 2  # the blocker's wave, then all five requests left-padded in one batch
    for req, out in zip(requests, completions):
        assert len(out.token_ids) == 12 and out.finish_reason == "length" and out.versions == (0,) * 12
        expected = teacher_forced(reference, req, out.token_ids)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), req
    greedy_req, greedy = requests[3], completions[3]
    ids = list(greedy_req.prompt_token_ids)
    penalty = RepetitionPenaltyLogitsProcessor(penalty=1.2)
    for token in greedy.token_ids:  # greedy = argmax of the penalised forward at every step
        with torch.no_grad():
            assert int(penalty(torch.tensor([ids]), reference(torch.tensor([ids])).logits[:, -1]).argmax()) == token
        ids.append(token)


def test_stop_token_ends_completion_and_is_kept_and_length_limit_says_length():
    model, tokenizer = build_tiny(0)

    async def main():
        engine = LocalEngine(model, tokenizer)
        await engine.start()
        try:
            free = await engine.generate(request(0, PROMPTS[0], tokenizer, temperature=0.0, max_new_tokens=10))
            stop = free.token_ids[4]
            first = free.token_ids.index(stop)
            stopped = await engine.generate(
                request(1, PROMPTS[0], tokenizer, temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))
            )
            return free, stopped, first
        finally:
            await engine.aclose()

    free, stopped, first = run(main())
    assert free.finish_reason == "length" and len(free.token_ids) == 10 and free.truncated
    assert stopped.finish_reason == "stop" and not stopped.truncated
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is included ...
    assert stopped.logprobs == free.logprobs[: first + 1]  # ... with its logprob
    assert stopped.text == tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)  # ... but not in text


def test_same_seed_same_completion_different_seed_different_completion():
    model, tokenizer = build_tiny(0)

    async def main():
        engine = LocalEngine(model, tokenizer)
        await engine.start()
        try:
            a = await engine.generate(request(0, PROMPTS[2], tokenizer, seed=42, max_new_tokens=30))
            b = await engine.generate(request(1, PROMPTS[2], tokenizer, seed=42, max_new_tokens=30))
            c = await engine.generate(request(2, PROMPTS[2], tokenizer, seed=43, max_new_tokens=30))
            twins = await asyncio.gather(*(engine.generate(request(i, PROMPTS[2], tokenizer, seed=7, max_new_tokens=30)) for i in (3, 4)))
            greedy = await engine.generate(request(5, PROMPTS[0], tokenizer, temperature=0.0, max_new_tokens=10))
            nucleus = await engine.generate(request(6, PROMPTS[0], tokenizer, top_p=1e-6, max_new_tokens=10))
            return a, b, c, twins, greedy, nucleus
        finally:
            await engine.aclose()

    a, b, c, (d, e), greedy, nucleus = run(main())
    assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
    assert a.token_ids != c.token_ids
    assert d.token_ids == e.token_ids  # same seed, same batch
    # a nucleus of one token samples the argmax, with probability 1 in the distribution sampled (log q = 0)
    assert nucleus.token_ids == greedy.token_ids
    assert nucleus.logprobs == (0.0,) * 10
    assert all(lp < -0.1 for lp in greedy.logprobs)


def test_cancelled_requests_leave_the_batch_and_the_queue():
    model, tokenizer = build_tiny(0)
    reference, _ = build_tiny(0)
    short = [request(i, p, tokenizer, max_new_tokens=8) for i, p in enumerate(PROMPTS[:2])]

    async def main():
        gate = Gate(1, 4)
        engine = LocalEngine(model, tokenizer, step_hook=gate)
        await engine.start()
        try:
            blocker = await park_on_blocker(engine, gate, tokenizer)
            long_req = request(7, PROMPTS[2], tokenizer, max_new_tokens=400)
            long_task, *short_tasks = await enqueue(engine, [long_req, *short])
            gate.open(1)
            await gate.wait(4)  # wave 2 ran 3 steps: the long request holds 3 tokens
            long_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long_task
            (queued_task,) = await enqueue(engine, [request(8, "queued", tokenizer, max_new_tokens=50)])
            queued_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued_task
            assert engine.stats()["queued"] == 0
            gate.open(4)
            await blocker
            outs = await asyncio.gather(*short_tasks)
            after_wave = engine.stats()
            extra = await engine.generate(request(9, "x", tokenizer, max_new_tokens=5))
            return outs, after_wave, extra, engine.stats()
        finally:
            for step in (1, 4):
                gate.open(step)
            await engine.aclose()

    outs, after_wave, extra, final = run(main())
    assert after_wave["active"] == 0 and after_wave["queued"] == 0
    # 1 (blocker) + 3 (long, cancelled after its third token) + 2 x 8 (short); the queued one never ran
    assert after_wave["tokens_generated"] == 1 + 3 + 16 and after_wave["waves"] == 2
    assert final["tokens_generated"] == after_wave["tokens_generated"] + len(extra.token_ids)
    for req, out in zip(short, outs):  # rows kept after the cancelled one was dropped from the cache
        assert len(out.token_ids) == 8
        assert torch.allclose(torch.tensor(out.logprobs), teacher_forced(reference, req, out.token_ids), atol=1e-4)


def test_weight_swap_mid_request_stamps_versions_and_uses_new_weights():
    model, tokenizer = build_tiny(0)
    old, _ = build_tiny(0)
    new, _ = build_tiny(1)
    requests = [request(0, PROMPTS[2], tokenizer, max_new_tokens=12), request(1, PROMPTS[1], tokenizer, max_new_tokens=12)]

    async def main():
        gate = Gate(1, 4)
        engine = LocalEngine(model, tokenizer, step_hook=gate)
        await engine.start()
        try:
            blocker = await park_on_blocker(engine, gate, tokenizer)
            tasks = await enqueue(engine, requests)
            gate.open(1)
            await gate.wait(4)  # 3 tokens generated at version 0
            load = asyncio.create_task(engine.load_weights(new.state_dict(), version=1))
            await asyncio.sleep(0)  # one loop turn: the load is queued (checked next)
            assert engine.stats()["pending_weight_loads"] == 1 and engine.serving_version == 0
            gate.open(4)
            await load
            assert engine.serving_version == 1
            await blocker
            outs = await asyncio.gather(*tasks)
            later = await engine.generate(request(2, PROMPTS[0], tokenizer, max_new_tokens=4))
            return outs, later
        finally:
            for step in (1, 4):
                gate.open(step)
            await engine.aclose()

    outs, later = run(main())
    for req, out in zip(requests, outs):
        assert out.versions == (0,) * 3 + (1,) * 9 and out.dispatch_version == 0 and out.generation_version == 0
        got = torch.tensor(out.logprobs)
        assert torch.allclose(got[:3], teacher_forced(old, req, out.token_ids)[:3], atol=1e-4)
        assert torch.allclose(got[3:], teacher_forced(new, req, out.token_ids)[3:], atol=1e-4)
        assert not torch.allclose(got[3:], teacher_forced(old, req, out.token_ids)[3:], atol=1e-2)
    assert later.dispatch_version == 1 and set(later.versions) == {1}


def test_load_weights_rejects_mismatched_state_and_older_versions():
    model, tokenizer = build_tiny(0)

    async def main():
        engine = LocalEngine(model, tokenizer)
        await engine.start()
        try:
            state = build_tiny(1)[0].state_dict()
            with pytest.raises(ValueError, match="missing keys"):
                await engine.load_weights({k: v for k, v in state.items() if "layers.0." not in k}, 1)
            with pytest.raises(ValueError, match="unknown keys"):
                await engine.load_weights({**state, "bogus.weight": torch.zeros(1)}, 1)
            await engine.load_weights(None, 2)  # version bump, same weights
            assert engine.serving_version == 2
            with pytest.raises(ValueError, match="must not decrease"):
                await engine.load_weights(state, 1)
            with pytest.raises(PromptRejectedError, match="max_position_embeddings"):
                await engine.generate(GenerationRequest("r", 0, (5,) * 500, SamplingParams(max_new_tokens=32), seed=0))
            with pytest.raises(PromptRejectedError, match="empty"):
                await engine.generate(GenerationRequest("r", 0, (), SamplingParams(max_new_tokens=32), seed=0))
            out = await engine.generate(request(0, "ok", tokenizer, max_new_tokens=3))  # still serving
            assert out.versions == (2, 2, 2)
        finally:
            await engine.aclose()

    run(main())


def test_aclose_with_requests_in_flight_is_quick_and_leaves_no_thread():
    model, tokenizer = build_tiny(0)

    async def main():
        gate = Gate(2)
        engine = LocalEngine(model, tokenizer, step_hook=gate)
        await engine.start()
        tasks = [asyncio.create_task(engine.generate(request(i, p, tokenizer, max_new_tokens=400))) for i, p in enumerate(PROMPTS)]
        await gate.wait(2)
        closing = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0)  # aclose has marked the engine closing (one loop turn)
        started = time.monotonic()
        gate.open(2)
        await closing
        elapsed = time.monotonic() - started
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await engine.aclose()  # idempotent
        with pytest.raises(GenerationError, match="closed"):
            await engine.generate(request(9, "x", tokenizer))
        with pytest.raises(GenerationError, match="closed"):
            await engine.load_weights(None, 1)
        return results, elapsed, engine.stats()

    results, elapsed, stats = run(main())
    assert elapsed < 10
    assert all(isinstance(r, GenerationError) and "closed" in str(r) for r in results)
    assert stats["active"] == 0 and stats["queued"] == 0
    assert engine_threads() == []


def test_exception_in_forward_fails_requests_with_chained_generation_error():
    model, tokenizer = build_tiny(0)
    calls = 0

    def fault(module, args):
        nonlocal calls
        calls += 1
        if calls == 3:  # prefill, one decoding step, then the fault
            raise RuntimeError("injected fault in layer 1")

    model.model.layers[1].register_forward_pre_hook(fault)

    async def main():
        engine = LocalEngine(model, tokenizer)
        await engine.start()
        try:
            results = await asyncio.gather(
                *(engine.generate(request(i, p, tokenizer, max_new_tokens=20)) for i, p in enumerate(PROMPTS[:2])),
                return_exceptions=True,
            )
            with pytest.raises(GenerationError, match="injected fault") as later:
                await engine.generate(request(5, "x", tokenizer))
            assert isinstance(engine.failure, RuntimeError)
            return results, later.value, engine.stats()
        finally:
            await engine.aclose()

    results, later, stats = run(main())
    for error in [*results, later]:
        assert isinstance(error, GenerationError) and not isinstance(error, TransientGenerationError)
        assert isinstance(error.__cause__, RuntimeError) and "injected fault" in str(error)
        assert error.backend == "local"
    assert results[0] is not results[1]  # a fresh error per request
    assert stats["active"] == 0
    assert engine_threads() == []
