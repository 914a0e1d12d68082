"""On-policy distillation's training step on real tiny models: the distillation loss's gradient lowers the
student-teacher KL on a fixed batch (the teacher and its worker: tests/unit/test_distill.py)."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.distill.judge import kl_mean, taught_rollouts
from asyncgrpo.telemetry.keys import DISTILL_KEYS, TRAIN_KEYS, offpolicy_keys
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.types import Group
from tests.tiny_models import tiny_llama
from tests.unit.test_distill import TEMPERATURE, cfg_distill, completion_of, direct_logprobs, prompt_of

pytestmark = pytest.mark.timeout(120)



def sample(model, prompts: list[list[int]], n: int, rng: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """n tokens sampled from `model` at TEMPERATURE after each prompt (all of one length), with their log-probs."""
    ids = torch.tensor(prompts)
    logprobs = []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float() / TEMPERATURE, -1)
            tokens = torch.multinomial(logp.exp(), 1, generator=rng)
            logprobs.append(logp.gather(-1, tokens))
            ids = torch.cat([ids, tokens], dim=1)
    width = len(prompts[0])
    return [(row[width:], lps) for row, lps in zip(ids.tolist(), torch.cat(logprobs, dim=1).tolist())]


def exact_kl(student, teacher, samples: list[tuple[list[int], list[int]]]) -> float:
    """Mean over completion positions of KL(student || teacher) over the whole vocabulary, at TEMPERATURE
    (prompts of one length, completions of one length)."""
    width = len(samples[0][0])
    ids = torch.tensor([prompt + completion for prompt, completion in samples])
    with torch.no_grad():
        s = torch.log_softmax(student(input_ids=ids).logits[:, width - 1 : -1].float() / TEMPERATURE, -1)
        t = torch.log_softmax(teacher(input_ids=ids).logits[:, width - 1 : -1].float() / TEMPERATURE, -1)
        return float((s.exp() * (s - t)).sum(-1).mean())


def test_the_distillation_loss_lowers_the_student_teacher_kl_on_a_fixed_batch():
    student, teacher = tiny_llama(0), tiny_llama(1).eval()
    trainer = TorchTrainer(student, None, cfg_distill())
    prompts = [[1, 3 + i % 20, 4 + i % 7] for i in range(32)]
    sampled = sample(trainer.model, prompts, 8, torch.Generator().manual_seed(0))
    groups, samples = [], []
    for i, (prompt, (completion, logprobs)) in enumerate(zip(prompts, sampled)):
        rollouts = taught_rollouts([completion_of(completion, logprobs)], [direct_logprobs(teacher, prompt, completion)])
        groups.append(Group(prompt=prompt_of(prompt, i), rollouts=rollouts, seq=i))
        samples.append((prompt, completion))
    before = exact_kl(trainer.model, teacher, samples)
    first = trainer.train_step(groups)
    assert list(first) == [*TRAIN_KEYS, *DISTILL_KEYS, *offpolicy_keys(trainer.cfg.rollout.max_staleness)]
    assert first["distill/kl_mean"] == pytest.approx(kl_mean(groups)) and first["advantage/mean"] == pytest.approx(-kl_mean(groups))
    for _ in range(2):
        trainer.train_step(groups)
    after = exact_kl(trainer.model, teacher, samples)
    assert after < 0.9 * before, f"KL(student || teacher) on the batch went from {before:.4f} to {after:.4f}"
