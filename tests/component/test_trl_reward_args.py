"""TRL's reward arguments: `trainer_state`, `log_metric` and `log_extra`, passed as trl 1.16's GRPOTrainer passes them
(to functions that name them or take **kwargs), in-process and in worker processes (the callbacks cross the process
boundary as data), with the logged metrics drained per step and the extra columns kept per completion."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from asyncgrpo.errors import RewardError
from asyncgrpo.rewards.resolve import resolve_rewards
from asyncgrpo.rewards.scoring import RewardScorer
from asyncgrpo.rewards.trl_args import TrainerState
from asyncgrpo.types import Prompt

pytestmark = pytest.mark.timeout(60)

PROMPT = Prompt(id=0, text="say a: ", token_ids=(1, 2), columns={"answer": "a"})

# The shape of a TRL reward that schedules on the step and logs (TRL's docs: trainer_state, log_metric, log_extra).
TRL_REWARDS = '''
def scheduled(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    progress = trainer_state.global_step / trainer_state.max_steps
    lengths = [len(c) for c in completions]
    log_metric("progress", progress)
    log_metric("len_mean", sum(lengths) / len(lengths))
    log_extra("length", lengths)
    return [progress * n for n in lengths]

def plain(prompts, completions):
    return [1.0] * len(completions)

def bad_metric(prompts, completions, log_metric, **kwargs):
    log_metric("nan", float("nan"))
    return [0.0] * len(completions)

def bad_extra(prompts, completions, log_extra, **kwargs):
    log_extra("length", [1])
    return [0.0] * len(completions)
'''


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "trl_style_rewards.py"
    path.write_text(textwrap.dedent(TRL_REWARDS))
    return str(path)


STATE = TrainerState(global_step=3, max_steps=10)


def score(module, names, completions, isolation, state=STATE):
    specs = [f"{module}:{name}" for name in names]

    async def go():
        async with RewardScorer(resolve_rewards(specs), isolation=isolation, specs=specs, workers=1,
                                trainer_state=lambda: state) as scorer:
            first = await scorer.score(PROMPT, completions)
            second = await scorer.score(PROMPT, completions[:1])
            return first, second, scorer.log.drain(), scorer.log.drain()

    return asyncio.run(go())


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_trl_reward_schedules_on_the_step_and_logs_metrics_and_columns(module, isolation):
    first, second, drained, again = score(module, ["scheduled", "plain"], ["aa", "aaaa"], isolation)
    assert [s.terms["scheduled"] for s in first] == [pytest.approx(0.6), pytest.approx(1.2)]  # 3/10 x length
    assert [s.extra for s in first] == [{"length": 2}, {"length": 4}]
    assert second[0].extra == {"length": 2}
    # means over every call since the last drain: progress 0.3 twice; len_mean 3 (first group) and 2 (second)
    assert drained == {"user/progress": pytest.approx(0.3), "user/len_mean": pytest.approx(2.5)}
    assert again == {}


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize(("name", "message"), [
    ("bad_metric", "log_metric('nan', nan): the value must be a finite number"),
    ("bad_extra", "log_extra('length', values): give one value per completion (2), got 1 values"),
])
def test_a_bad_log_call_is_a_reward_error_at_its_call_site(module, isolation, name, message):
    with pytest.raises(RewardError) as err:
        score(module, [name], ["aa", "aaaa"], isolation)
    assert f"reward function {name!r} raised" in str(err.value) and message in str(err.value)
