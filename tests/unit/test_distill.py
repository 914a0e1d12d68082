"""On-policy distillation on real tiny models: the teacher's log-probs equal a direct computation, and the teacher
worker batches, classifies its errors and withdraws what its callers gave up (the distillation loss's gradient
lowering the student-teacher KL: tests/component/test_distill_training.py)."""

from __future__ import annotations

import asyncio
import math
import random
import threading

import pytest
import torch

from asyncgrpo.config import Config
from asyncgrpo.distill.loss import distill_advantages
from asyncgrpo.distill.teacher import TeacherWorker, teacher_logprobs
from asyncgrpo.errors import TeacherError, TeacherTimeoutError
from asyncgrpo.types import Completion, Prompt
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.timeout(120)

TEMPERATURE = 0.7


def direct_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log pi of `completion` under `model` at TEMPERATURE: one unpadded sequence, computed by hand."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def random_samples(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [
        ([1] + [rng.randrange(3, 32) for _ in range(rng.randrange(1, 7))], [rng.randrange(3, 32) for _ in range(rng.randrange(0, 9))])
        for _ in range(n)
    ]


def prompt_of(ids: list[int], pid: int = 0) -> Prompt:
    return Prompt(id=pid, text="", token_ids=tuple(ids))


def completion_of(ids: list[int], logprobs: list[float] | None = None) -> Completion:
    return Completion(tuple(ids), tuple(logprobs or [0.0] * len(ids)), (0,) * len(ids), "length", 0)


def test_batched_teacher_logprobs_equal_a_direct_computation():
    teacher = tiny_llama(1).eval()
    samples = [*random_samples(0, 12), ([1, 5], [])]  # varied prompt and completion lengths, an empty completion
    batched = teacher_logprobs(teacher, samples, TEMPERATURE)
    for (prompt, completion), got in zip(samples, batched):
        want = direct_logprobs(teacher, prompt, completion) if completion else []
        assert len(got) == len(completion)
        assert got == pytest.approx(want, abs=1e-5)


def worker(model, **kwargs) -> TeacherWorker:
    options = {"temperature": TEMPERATURE, "batch_size": 4, "queue_size": 8, "timeout_s": 30.0, "name": "t"}
    return TeacherWorker(model, **{**options, **kwargs})


def test_the_worker_scores_concurrent_callers_in_batches_like_a_direct_computation():
    teacher = tiny_llama(1)
    samples = random_samples(1, 20)

    async def main():
        w = worker(teacher)
        await w.start()
        try:
            results = await asyncio.gather(*(w.score(prompt_of(p, i), [completion_of(c)]) for i, (p, c) in enumerate(samples)))
            return results, w.state()
        finally:
            await w.aclose()

    threads_before = set(threading.enumerate())
    results, state = asyncio.run(main())
    assert [t for t in set(threading.enumerate()) - threads_before if t.is_alive()] == []
    for (prompt, completion), [got] in zip(samples, results):
        assert got == pytest.approx(direct_logprobs(teacher, prompt, completion) if completion else [], abs=1e-5)
    batches = int(state.split(" batches scored")[0].rsplit(" ", 1)[1])
    assert batches < len(samples)  # 20 callers at once fill batches of up to 4


def test_teacher_errors_are_classified_and_the_worker_goes_on():
    teacher = tiny_llama(1)
    forward = teacher.forward
    fail = {"next": True}

    def flaky_forward(*args, **kwargs):
        if fail["next"]:
            fail["next"] = False
            raise RuntimeError("CUDA out of memory (simulated)")
        out = forward(*args, **kwargs)
        if fail.pop("nan", False):
            out.logits[:] = float("nan")
        return out

    teacher.forward = flaky_forward

    async def main():
        w = worker(teacher)
        await w.start()
        try:
            with pytest.raises(TeacherError, match="outside teacher 't'.s vocabulary of 32"):
                await w.score(prompt_of([1, 2]), [completion_of([40])])
            with pytest.raises(TeacherError, match="failed to score a batch of 1 samples: RuntimeError: CUDA out of memory") as info:
                await w.score(prompt_of([1, 2]), [completion_of([5, 6])])
            assert isinstance(info.value.__cause__, RuntimeError)
            fail["nan"] = True
            with pytest.raises(TeacherError, match="FloatingPointError: the teacher's log-probs are not all finite"):
                await w.score(prompt_of([1, 2]), [completion_of([5, 6])])
            return await w.score(prompt_of([1, 2]), [completion_of([5, 6])])  # the next batch is scored
        finally:
            await w.aclose()

    assert asyncio.run(main())[0] == pytest.approx(direct_logprobs(teacher, [1, 2], [5, 6]), abs=1e-5)


def test_a_teacher_that_does_not_answer_in_time_raises_a_timeout_and_withdraws_the_sample():
    teacher = tiny_llama(1)
    forward = teacher.forward
    release = threading.Event()

    def slow_forward(*args, **kwargs):
        release.wait(timeout=30)
        return forward(*args, **kwargs)

    teacher.forward = slow_forward

    async def main():
        w = worker(teacher, batch_size=1, timeout_s=0.2)
        await w.start()
        try:
            first = asyncio.create_task(w.score(prompt_of([1, 2], 1), [completion_of([5])]))  # held by the slow forward
            await asyncio.sleep(0.05)
            with pytest.raises(TeacherTimeoutError, match="of prompt 2 within distill.timeout_s = 0.2 s .teacher t: 1 samples queued, 1 being"):
                await w.score(prompt_of([1, 3], 2), [completion_of([6])])  # queued behind it (the 1 queued), gives up
            with pytest.raises(TeacherTimeoutError):
                await first
            assert "0 samples queued" in w.state()  # the timed-out samples left the queue
        finally:
            release.set()
            await w.aclose()
        with pytest.raises(TeacherError, match="is closed"):
            await w.score(prompt_of([1, 2]), [completion_of([5])])

    asyncio.run(main())


def cfg_distill(**train) -> Config:
    return Config.model_validate({
        "algorithm": "distill",
        "train": {"lr": 1e-3, "micro_batch_size": 64, **train},
        "generation": {"temperature": TEMPERATURE},
        "rollout": {"group_size": 1, "min_group_survivors": 1},
    })


def test_distill_advantages_are_minus_the_per_token_kl_on_the_mask_only():
    gen = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-100.0, 5.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    got = distill_advantages(gen, teacher, mask)
    assert got.tolist() == [[-0.5, 1.0, 0.0], [-20.0, 0.0, 0.0]]  # clamped to +-20; padding 0
    assert not got.requires_grad and all(math.isfinite(v) for v in got.flatten().tolist())


def test_a_teacher_with_another_vocabulary_than_the_student_is_refused():
    from types import SimpleNamespace

    from asyncgrpo.distill.teacher import build_teacher
    from asyncgrpo.errors import ConfigError

    cfg = cfg_distill()
    with pytest.raises(ConfigError, match="distill.teacher = 'builtin:tiny' has a vocabulary of 55 tokens that differs from the student's .2 tokens"):
        build_teacher(cfg, SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}))
    from asyncgrpo.models.tiny import build_tiny_tokenizer

    teacher = build_teacher(cfg, build_tiny_tokenizer())
    assert teacher.name == "builtin:tiny" and teacher.temperature == TEMPERATURE
