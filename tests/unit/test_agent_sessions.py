"""The gateway's pure parts: the tool-call parser (agents/toolcalls.py), the wire format (agents/wire.py) and a session's
bookkeeping (agents/session.py), with the simulator's one-id-per-character codec."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.agents.session import Limits, Session
from asyncgrpo.agents.toolcalls import parse_tool_calls
from asyncgrpo.agents.wire import REFUSALS, Refused, chat_request, text_request
from asyncgrpo.environments.conversation import CharCodec
from asyncgrpo.metric_names import AGENT_REFUSALS, COUNTER_NAMES
from asyncgrpo.types import Completion

CODEC = CharCodec()
TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_text_without_a_tool_call_is_content():
    assert parse_tool_calls("just words", 1).content == "just words"


def test_hermes_calls_are_parsed_in_order_with_the_text_around_them():
    turn = parse_tool_calls("Let me compute. " + call("calc", expression="2*3") + "\n" + call("calc", expression="4"), 2)
    assert turn.content == "Let me compute." and not turn.unparsed
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls] == [
        ("call_2_0", "calc", {"expression": "2*3"}), ("call_2_1", "calc", {"expression": "4"})]


def test_smollm2_lists_and_string_arguments_are_parsed():
    turn = parse_tool_calls('<tool_call>[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]</tool_call>', 1)
    assert turn.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls] == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>{not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
    call("a", x=1) + '<tool_call>{"name": "b"',  # the second block never closed (cut by max_tokens)
    "<tool_call></tool_call>",
])
def test_an_unparseable_call_is_returned_whole_as_text_and_marked(text):
    turn = parse_tool_calls(text, 1)
    assert turn.content == text and turn.tool_calls == () and turn.unparsed


def test_every_refusal_an_episode_counts_has_a_counter():
    assert set(REFUSALS) - {"unknown_session"} == set(AGENT_REFUSALS)
    assert {f"agent/refused/{r}" for r in AGENT_REFUSALS} <= set(COUNTER_NAMES)


@pytest.mark.parametrize(("body", "reason", "words"), [
    ([1], "malformed", "not a JSON object"),
    ({"messages": []}, "malformed", "messages = []"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "malformed", "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "malformed", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "unsupported", "stream = true"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "unsupported", "n = 2"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "malformed", "max_tokens = 0"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "malformed", "tools[0]"),
])
def test_malformed_chat_requests_are_refused_naming_the_field(body, reason, words):
    with pytest.raises(Refused) as refused:
        chat_request(body)
    assert refused.value.reason == reason and words in str(refused.value) and refused.value.status == 400


def completion(text: str) -> Completion:
    ids = CODEC.encode(text)
    return Completion(token_ids=ids, logprobs=(-1.0,) * len(ids), versions=(3,) * len(ids), finish_reason="stop", dispatch_version=3,
                      text=text)


def session(**limits) -> Session:
    return Session(CODEC, Limits(**{"max_turns": 3, "max_tokens": 200, "max_prompt_tokens": 100, "max_new_tokens": 16, **limits}), "agent:x", "s")


def chat(*messages, tools=(), **body):
    return chat_request({"messages": list(messages), "tools": list(tools), **body})


USER = {"role": "user", "content": "hi"}


def test_a_session_keeps_the_sampled_ids_and_adds_the_agents_messages_as_the_template_delta():
    s = session()
    context, budget = s.plan_chat(chat(USER, max_tokens=5))
    assert context == CODEC.encode("user: hi\nassistant: ") and budget == 5
    s.add_turn(completion("yo"))
    context, budget = s.plan_chat(chat(USER, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}))
    assert context == CODEC.encode("user: hi\nassistant: ") + CODEC.encode("yo") + CODEC.encode("user: more\nassistant: ")
    assert budget == 16
    conv = s.conversation
    assert conv.mask == [True] * 2 + [False] * len(CODEC.encode("user: more\nassistant: "))
    assert s.episode_messages() == [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]


def test_tool_calls_are_returned_parsed_and_must_come_back_as_they_were_given():
    s = session()
    s.plan_chat(chat(USER, tools=[TOOL]))
    turn = s.add_turn(completion(call("calc", expression="1+1")))
    given = {"role": "assistant", "content": None, "tool_calls": [{"id": "anything", "type": "function", "function": {
        "name": "calc", "arguments": turn.tool_calls[0]["function"]["arguments"]}}]}
    result = {"role": "tool", "tool_call_id": "call_1_0", "content": "2"}
    s.plan_chat(chat(USER, given, result, tools=[TOOL]))  # accepted: ids and the arguments' spelling aside, the same message
    s.add_turn(completion("2"))
    changed = {**given, "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"expression": "9"}'}}]}
    with pytest.raises(Refused, match=r"messages\[1\]"):
        s.plan_chat(chat(USER, changed, result, {"role": "assistant", "content": "2"}, USER, tools=[TOOL]))
    with pytest.raises(Refused, match="tools differ"):
        s.plan_chat(chat(USER, given, result, {"role": "assistant", "content": "2"}, USER))


def test_a_refused_request_leaves_the_session_as_it_was():
    s = session(max_tokens=40)
    s.plan_chat(chat(USER))
    s.add_turn(completion("yo"))
    before = list(s.conversation.ids)
    history = [USER, {"role": "assistant", "content": "yo"}]
    with pytest.raises(Refused, match="adds none"):
        s.plan_chat(chat(*history))
    with pytest.raises(Refused) as refused:
        s.plan_chat(chat(*history, {"role": "user", "content": "x" * 50}))
    assert refused.value.reason == "context_limit" and "env.max_tokens = 40" in str(refused.value) and s.limit_hit == "max_tokens"
    assert s.conversation.ids == before and len(s.public) == 2
    s.plan_chat(chat(*history, {"role": "user", "content": "ok"}))  # the session goes on


def test_the_turn_limit_and_the_prompt_limit_are_refused_naming_the_keys():
    s = session(max_turns=1)
    s.plan_chat(chat(USER))
    s.add_turn(completion("yo"))
    with pytest.raises(Refused, match="env.max_turns = 1") as refused:
        s.plan_chat(chat(USER, {"role": "assistant", "content": "yo"}, USER))
    assert refused.value.reason == "turn_limit" and s.limit_hit == "max_turns"
    with pytest.raises(Refused, match="data.max_prompt_tokens = 100"):
        session().plan_chat(chat({"role": "user", "content": "x" * 200}))


def test_a_text_session_extends_its_text_and_refuses_the_other_endpoint():
    s = session()
    context, _ = s.plan_text(text_request({"prompt": "2+2="}))
    assert context == CODEC.encode("2+2=")
    s.add_turn(completion("4"))
    context, _ = s.plan_text(text_request({"prompt": "2+2=4\n3+3="}))
    assert context == CODEC.encode("2+2=") + CODEC.encode("4") + CODEC.encode("\n3+3=")
    assert s.conversation.mask == [True] + [False] * 5
    with pytest.raises(Refused, match="does not extend"):
        s.plan_text(text_request({"prompt": "2+2=5"}))
    with pytest.raises(Refused, match="other endpoint"):
        s.plan_chat(chat(USER))


def test_tools_are_rendered_by_a_template_that_renders_them_and_refused_by_one_that_does_not():
    from asyncgrpo.environments.conversation import TokenizerCodec
    from asyncgrpo.models.tiny import CHAT_TEMPLATE, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    plain = Session(TokenizerCodec(tokenizer), Limits(3, 200, 100, 16), "agent:x", "s")
    with pytest.raises(Refused, match="does not render tools") as refused:
        plain.plan_chat(chat(USER, tools=[TOOL]))
    assert refused.value.reason == "unsupported" and plain.conversation is None
    tokenizer.chat_template = "{% for tool in tools or [] %}tool {{ tool['function']['name'] }}\n{% endfor %}" + CHAT_TEMPLATE
    with_tools = Session(TokenizerCodec(tokenizer), Limits(3, 200, 100, 16), "agent:x", "s")
    context, _ = with_tools.plan_chat(chat(USER, tools=[TOOL]))
    assert tokenizer.decode(context) == "tool calc\nuser: hi\nassistant: "


def test_an_agent_with_process_isolation_is_a_config_error_naming_the_fix():
    from asyncgrpo.errors import ConfigError
    from tests.sim.fakes import recipe

    with pytest.raises(ConfigError, match="runs as a task of the run's event loop.*env.isolation: thread.*agent-command:python my_agent.py"):
        recipe(env={"factory": "agent:tests.agents:one_turn", "isolation": "process"})
    assert recipe(env={"factory": "agent-command:sh agent.sh", "isolation": "process"}).env.isolation == "process"  # a process anyway
