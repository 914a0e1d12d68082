"""An agent written with an agent framework from the package index, Hugging Face's smolagents, trains through the gateway.
smolagents rewrites its history: it sends the model's tool call back as text ("Calling tools: ...") and the tool's result as a
user "Observation", so its second request does not extend the session's conversation. With `env.agent_history: split` that
request starts a second sample of the episode (its prompt the messages as smolagents sent them); both samples are trained
with the episode's advantage."""

from __future__ import annotations

import asyncio
import json

from asyncgrpo.training.batch import sequences
from tests.agent_runs import CODEC, TextGenerator, first_batch
from tests.sim.fakes import recipe


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_smolagents_tool_calling_agent_that_rewrites_its_history_trains_as_one_sample_per_rewrite():
    turns = {"-t0": _call("calculate", {"expression": "2*3"}), "-t1": _call("final_answer", {"answer": "6"})}

    def answer(request):
        if request.request_id.endswith("-t1"):
            generator.version = 1  # the second sample's tokens come from newer weights than the first's
        return turns[request.request_id[-3:]]

    generator = TextGenerator(answer)
    # smolagents' system prompt (its instructions and the tools' schemas) is ~3,400 characters, one token each here.
    cfg = recipe(data={"builtin_size": 1, "num_epochs": 1, "max_prompt_tokens": 8192}, reward={"functions": []},
                 env={"factory": "agent:tests.smol_agents:calculator", "max_turns": 3, "step_timeout_s": 30.0, "agent_history": "split"},
                 generation={"max_inflight": 2}, rollout={"group_size": 2, "groups_per_step": 1, "min_group_survivors": 2})
    collector, batch = asyncio.run(first_batch(cfg, generator))
    group = batch[0]
    rollout = group.rollouts[0]
    last = rollout.completion
    assert rollout.reward == 1.0 and last.episode.turns == 2 and len(last.segments) == 1
    assert collector.counters["env/errors_total"] == 0 and collector.counters["agent/refused/malformed"] == 0
    assert collector.counters["agent/split_samples_total"] == 2  # one split per episode, counted
    # The reward functions get smolagents' own account of the episode: its rewritten turn, the observation, the final call.
    messages = [dict(m) for m in last.episode.messages]
    assert messages[0]["role"] == "assistant" and messages[0]["content"].startswith("Calling tools:")
    assert messages[1] == {"role": "user", "content": "Observation:\n6"}  # smolagents ran the tool
    assert messages[2]["tool_calls"][0]["function"] == {"name": "final_answer", "arguments": {"answer": "6"}}
    # Sample 1: the first request's prompt and the tool call as sampled. Sample 2: the second request rendered as sent.
    first, = last.segments
    assert first.token_ids == CODEC.encode(turns["-t0"]) and all(first.loss_mask)
    assert last.token_ids == CODEC.encode(turns["-t1"]) and all(last.loss_mask)
    assert first.prompt_token_ids in {r.prompt_token_ids for r in generator.requests if r.request_id.endswith("-t0")}
    assert last.prompt_token_ids in {r.prompt_token_ids for r in generator.requests if r.request_id.endswith("-t1")}
    assert last.prompt_token_ids[-len(CODEC.encode("user: Observation:\n6\nassistant: ")):] == CODEC.encode(
        "user: Observation:\n6\nassistant: ")
    extension = first.prompt_token_ids + first.token_ids
    assert last.prompt_token_ids[: len(extension)] != extension  # the rewritten history: not the ids the model saw
    # The episode's versions are every sample's: its staleness is that of its oldest trained token.
    for r in group.rollouts:
        segment, = r.completion.segments
        assert r.completion.episode.version_span == (segment.versions[0], 1) == (r.completion.generation_version, 1)
    assert min(r.completion.generation_version for r in group.rollouts) == 0
    # The trainer gets one sequence per sample, each with its episode's advantage, every model token counted once.
    seqs = sequences(group, mask_truncated=False)
    assert len(seqs) == 2 * len(group.rollouts)
    assert [s.rollout.advantage for s in seqs] == [r.advantage for r in group.rollouts for _ in (0, 1)]
    assert sum(s.loss_tokens for s in seqs) == sum(r.completion.model_tokens for r in group.rollouts)
    assert [s.prompt_ids for s in seqs[:2]] == [first.prompt_token_ids, last.prompt_token_ids]
