"""Agents that rewrite their history (`env.agent_history`, agents/session.py): whether a request extends the session's
conversation or diverges from it, the samples a divergence starts, and how a split episode reaches the trainer (one
sequence per sample, every model token counted once, the oldest token of any sample its generation version)."""

from __future__ import annotations

import dataclasses

import pytest

from asyncgrpo.agents.session import Limits, Session
from asyncgrpo.agents.wire import Refused, chat_request, text_request
from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.types import Completion, Group, Prompt, Rollout

CODEC = CharCodec()
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "2*3?"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
# What smolagents sends back: the tool call as text, its result as a user message.
REWRITTEN = [USER, {"role": "assistant", "content": "Calling tools: calc 2*3"}, {"role": "user", "content": "Observation: 6"}]


def completion(text: str, version: int = 3) -> Completion:
    ids = CODEC.encode(text)
    return Completion(token_ids=ids, logprobs=(-1.0,) * len(ids), versions=(version,) * len(ids), finish_reason="stop",
                      dispatch_version=version, text=text)


def session(split: bool, **limits) -> Session:
    return Session(CODEC, Limits(**{"max_turns": 4, "max_tokens": 200, "max_prompt_tokens": 100, "max_new_tokens": 16, **limits}),
                   "agent:x", "s", split=split)


def chat(*messages, tools=(TOOL,), **body):
    return chat_request({"messages": list(messages), "tools": list(tools), **body})


def test_strict_refuses_a_rewritten_history_naming_the_key_and_keeps_the_session():
    s = session(split=False)
    s.plan_chat(chat(USER))
    s.add_turn(completion(CALL))
    before = list(s.conversation.ids)
    with pytest.raises(Refused, match=r"messages\[1\].*env.agent_history: split") as refused:
        s.plan_chat(chat(*REWRITTEN))
    assert refused.value.reason == "malformed" and refused.value.status == 400
    with pytest.raises(Refused, match="tools differ.*env.agent_history: split"):
        s.plan_chat(chat(*REWRITTEN, tools=()))
    assert s.conversation.ids == before and s.samples() == [s.conversation]


@pytest.mark.parametrize("split", [False, True])
def test_a_request_that_extends_the_conversation_stays_one_sample_either_way(split):
    s = session(split=split)
    s.plan_chat(chat(USER))
    turn = s.add_turn(completion(CALL))
    given = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": turn.tool_calls[0]["function"]}]}
    context, _ = s.plan_chat(chat(USER, given, {"role": "tool", "content": "6"}))
    assert context == CODEC.encode(CODEC.render([USER], add_generation_prompt=True, tools=[TOOL])) + CODEC.encode(CALL) + CODEC.encode(
        "tool: 6\nassistant: ")
    assert len(s.samples()) == 1
    with pytest.raises(Refused, match="adds none"):  # a second answer to the same turn: no new sample, split or not
        s.plan_chat(chat(USER, given, {"role": "tool", "content": "6"}))


def test_a_diverging_request_starts_a_sample_whose_prompt_is_its_messages_as_sent():
    s = session(split=True)
    first_prompt, _ = s.plan_chat(chat(USER))
    s.add_turn(completion(CALL))
    context, budget = s.plan_chat(chat(*REWRITTEN))
    assert context == CODEC.encode(CODEC.render(REWRITTEN, add_generation_prompt=True, tools=[TOOL]))
    assert budget == 16
    s.add_turn(completion("6", version=4))
    earlier, current = s.samples()
    assert earlier.prompt_ids == first_prompt and earlier.ids == list(CODEC.encode(CALL)) and all(earlier.mask)
    assert current.prompt_ids == context and current.ids == list(CODEC.encode("6")) and current.versions == [4]
    # The new sample goes on as any: a request that extends it adds the template's delta, masked out.
    context, _ = s.plan_chat(chat(*REWRITTEN, {"role": "assistant", "content": "6"}, {"role": "user", "content": "sure?"}))
    assert context == current.prompt_ids + CODEC.encode("6") + CODEC.encode("user: sure?\nassistant: ")
    assert len(s.samples()) == 2 and current.mask == [True] + [False] * len(CODEC.encode("user: sure?\nassistant: "))
    # The reward functions get the agent's own account: its last request after the first request's messages.
    assert s.episode_messages()[:2] == REWRITTEN[1:]
    assert s.turns == 2 and len(s.samples()) == 2  # max_turns counts the session's turns, every sample's


def test_dropping_turns_or_changing_tools_is_a_divergence_too():
    s = session(split=True)
    s.plan_chat(chat(USER))
    s.add_turn(completion("yo"))
    s.plan_chat(chat(USER, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}, tools=()))
    assert len(s.samples()) == 2 and s.tools == ()
    s.add_turn(completion("ok"))
    s.plan_chat(chat(USER, tools=()))  # the last three messages dropped: regenerate from the start
    assert len(s.samples()) == 3


def test_a_later_samples_prompt_and_room_are_bounded_by_the_prompt_and_episode_limits():
    s = session(split=True, max_prompt_tokens=60, max_tokens=40)
    s.plan_chat(chat(USER, tools=()))
    s.add_turn(completion("yo"))
    long = {"role": "user", "content": "x" * 60}
    context, budget = s.plan_chat(chat(USER, long, tools=()))  # over max_prompt_tokens: a later sample may use max_tokens too
    assert len(context) > 60 and budget == 60 + 40 - len(context) < 16
    s.add_turn(completion("y" * budget))
    with pytest.raises(Refused, match=r"data.max_prompt_tokens \+ env.max_tokens = 60 \+ 40") as refused:
        s.plan_chat(chat(USER, {"role": "user", "content": "z" * 100}, tools=()))
    assert refused.value.reason == "context_limit" and len(s.samples()) == 2  # refused: the session as it was


def test_text_mode_splits_a_prompt_that_does_not_start_with_the_text_so_far():
    strict, split = session(split=False), session(split=True)
    for s in (strict, split):
        s.plan_text(text_request({"prompt": "2*3="}))
        s.add_turn(completion("6"))
    with pytest.raises(Refused, match="env.agent_history: split"):
        strict.plan_text(text_request({"prompt": "Q: 2*3=6. Sure?"}))
    context, _ = split.plan_text(text_request({"prompt": "Q: 2*3=6. Sure?"}))
    assert context == CODEC.encode("Q: 2*3=6. Sure?") and len(split.samples()) == 2
    with pytest.raises(Refused, match="does not extend"):
        split.plan_text(text_request({"prompt": "Q: 2*3=6. Sure?"}))  # the same prompt again adds nothing


def test_agent_history_is_for_agents_and_takes_strict_or_split():
    from asyncgrpo.errors import ConfigError
    from tests.sim.fakes import recipe

    assert recipe(env={"factory": "agent:tests.agents:one_turn"}).env.agent_history == "strict"
    with pytest.raises(ConfigError, match="agent_history = 'split' with factory = 'tests.envs:AsyncEcho'.*Fix: remove env.agent_history"):
        recipe(env={"factory": "tests.envs:AsyncEcho", "agent_history": "split"})
    with pytest.raises(ConfigError, match="agent_history"):
        recipe(env={"factory": "agent:tests.agents:one_turn", "agent_history": "rewrite"})


def test_a_split_episode_trains_one_sequence_per_sample_with_the_episodes_advantage():
    from asyncgrpo.training.batch import sequences

    earlier = Completion(token_ids=(5, 6), logprobs=(-1.0, -1.0), versions=(1, 1), finish_reason="stop", dispatch_version=1,
                         loss_mask=(True, True), prompt_token_ids=(1, 2))
    last = Completion(token_ids=(7, 8, 9), logprobs=(-1.0, 0.0, -1.0), versions=(2, 2, 2), finish_reason="stop", dispatch_version=2,
                      loss_mask=(True, False, True), prompt_token_ids=(3,), segments=(earlier,))
    assert last.generation_version == 1 and last.model_tokens == 4  # the oldest token of any sample; every sample's model tokens
    group = Group(prompt=Prompt(id=0, text="p", token_ids=(1,)), rollouts=(Rollout(completion=last, reward=1.0, advantage=0.5),), seq=0)
    seqs = sequences(group, mask_truncated=True)
    assert [(s.prompt_ids, s.completion_ids, s.loss_tokens, s.rollout.advantage) for s in seqs] == [
        ((1, 2), (5, 6), 2, 0.5), ((3,), (7, 8, 9), 2, 0.5)]
    # an episode cut at its budget (its last sample truncated) is masked whole under mask_truncated, as unsplit
    cut = dataclasses.replace(last, finish_reason="length")
    cut_group = dataclasses.replace(group, rollouts=(Rollout(completion=cut, reward=1.0, advantage=0.5),))
    assert [s.has_loss for s in sequences(cut_group, mask_truncated=True)] == [False, False]
    assert [s.has_loss for s in sequences(cut_group, mask_truncated=False)] == [True, True]


def test_a_new_samples_turn_is_dispatched_with_the_oldest_version_of_every_sample_so_far():
    """The collector keeps the oldest version of an episode's model tokens as its member's dispatch version (its staleness):
    after a split, the earlier samples' tokens are still trained, so their version still counts."""
    import asyncio
    from collections import Counter

    from asyncgrpo.agents.episode import AgentEpisodes
    from asyncgrpo.agents.gateway import Call
    from asyncgrpo.types import GenerationRequest, SamplingParams
    from tests.sim.fakes import recipe

    cfg = recipe(env={"factory": "agent:tests.agents:one_turn", "agent_history": "split"})
    episodes = AgentEpisodes(cfg.env, cfg.generation, CODEC, Counter(), prompt_key="prompt", max_prompt_tokens=100,
                             report=lambda *args: None)
    s = session(split=True)
    request = GenerationRequest(request_id="r", prompt_id=0, prompt_token_ids=(), sampling=SamplingParams(max_new_tokens=16), seed=0)
    floors: list[int | None] = []

    async def generate(turn: GenerationRequest, floor: int | None) -> Completion:
        floors.append(floor)
        return completion(CALL, version=len(floors))  # turn 1 at version 1, turn 2 at version 2

    async def run() -> None:
        for messages in ([USER], REWRITTEN):
            await episodes._answer(Call("chat", {"messages": messages, "tools": [TOOL]}), s, request, generate, Prompt(0, "p", (1,)))

    asyncio.run(run())
    assert len(s.samples()) == 2 and floors == [None, 1]
