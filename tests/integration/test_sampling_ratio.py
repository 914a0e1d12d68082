"""Which distribution is optimised: the local engine samples from the truncated, penalised distribution and
reports its log q; the trainer scores the same distribution of its own logits, so at staleness 0 every
importance ratio is 1 (top-p, top-k, min-p, repetition penalty, and all of them at once)."""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.config import Config
from asyncgrpo.generation.local import LocalEngine
from asyncgrpo.models.tiny import build_tiny
from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.training.trainer import TorchTrainer
from asyncgrpo.types import GenerationRequest, Group, Prompt, Rollout
from asyncgrpo.wiring.collector import sampling_params

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["what is 2+2?", "1+1=", "hello, tiny model.", "x"]
KNOBS = [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.6), dict(repetition_penalty=1.3),
         dict(top_p=0.8, top_k=12, min_p=0.05, repetition_penalty=1.2)]


async def _groups(cfg: Config) -> list[Group]:
    model, tokenizer = build_tiny(0)
    sampling = sampling_params(cfg, (tokenizer.eos_token_id,))
    engine = LocalEngine(model, tokenizer, max_batch_size=16)
    await engine.start()
    try:
        groups = []
        for pid, text in enumerate(PROMPTS):
            ids = tuple(tokenizer(text)["input_ids"])
            requests = [GenerationRequest(f"{pid}-{k}", pid, ids, sampling, seed=100 * pid + k) for k in range(4)]
            completions = await asyncio.gather(*(engine.generate(r) for r in requests))
            rewards = [float(k % 2) for k in range(4)]
            advantages = group_advantages(rewards, scale_by_std=True)
            rollouts = tuple(Rollout(completion=c, reward=r, advantage=a) for c, r, a in zip(completions, rewards, advantages))
            groups.append(Group(prompt=Prompt(id=pid, text=text, token_ids=ids), rollouts=rollouts, seq=pid))
        return groups
    finally:
        await engine.aclose()


@pytest.mark.parametrize("knobs", KNOBS, ids=str)
def test_importance_ratio_is_one_at_staleness_zero(knobs):
    cfg = Config.model_validate({"generation": {"temperature": 1.0, "max_new_tokens": 16, **knobs},
                                 "rollout": {"group_size": 4}, "train": {"micro_batch_size": 8}})
    groups = asyncio.run(_groups(cfg))
    trainer = TorchTrainer(build_tiny(0)[0], None, cfg)  # the engine's weights: staleness 0
    metrics = trainer.train_step(groups)
    assert metrics["is_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["is_ratio/max"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["clip_frac"] == 0.0
