"""environments/conversation.py with builtin:tiny's tokenizer: the environment's tokens are the chat-template
delta, the sampled ids are kept as they are, and drift is counted only when they disagree with the template."""

from __future__ import annotations

from asyncgrpo.environments.conversation import Conversation, TokenizerCodec
from asyncgrpo.models.tiny import build_tiny_tokenizer
from asyncgrpo.types import Completion, Prompt

TOKENIZER = build_tiny_tokenizer()
CODEC = TokenizerCodec(TOKENIZER)


def chat_prompt(content: str) -> Prompt:
    messages = ({"role": "user", "content": content},)
    text = TOKENIZER.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return Prompt(id=0, text=text, token_ids=CODEC.encode(text), messages=messages)


def turn(text: str, *, eos: bool) -> Completion:
    ids = CODEC.encode(text) + ((TOKENIZER.eos_token_id,) if eos else ())
    return Completion(token_ids=ids, logprobs=(-0.5,) * len(ids), versions=(3,) * len(ids), finish_reason="stop", dispatch_version=3, text=text)


def test_turns_that_stop_on_eos_render_exactly_as_the_template_does():
    conv = Conversation(CODEC, chat_prompt("2+2?"))
    conv.start([{"role": "user", "content": "use calc"}])
    conv.add_model(turn("calc 2+2", eos=True))
    observation = [{"role": "tool", "content": "4"}]
    conv.observe(observation, conv.delta(observation))
    conv.add_model(turn("4", eos=True))
    conv.check_final_drift()
    assert conv.drift_turns == 0
    whole = TOKENIZER.apply_chat_template(conv.messages, tokenize=False, add_generation_prompt=False)
    assert TOKENIZER.decode(list(conv.context)) == whole
    assert conv.mask == [True] * 9 + [False] * len("tool: 4\nassistant: ") + [True] * 2


def test_a_turn_cut_before_eos_keeps_its_ids_and_the_template_supplies_the_rest_as_environment_tokens():
    conv = Conversation(CODEC, chat_prompt("hi"))
    sampled = turn("abc", eos=False)
    conv.add_model(sampled)
    observation = [{"role": "user", "content": "more"}]
    ids = conv.delta(observation)
    conv.observe(observation, ids)
    assert conv.drift_turns == 0
    assert tuple(conv.ids[:3]) == sampled.token_ids  # never re-rendered
    assert TOKENIZER.decode(list(ids)) == "<eos>user: more\nassistant: "


def test_ids_that_disagree_with_the_template_are_kept_and_counted_as_drift():
    conv = Conversation(CODEC, chat_prompt("hi"))
    odd = Completion(token_ids=CODEC.encode("xyz"), logprobs=(0.0,) * 3, versions=(0,) * 3, finish_reason="stop",
                     dispatch_version=0, text="abc")  # the text does not match the ids
    conv.add_model(odd)
    observation = [{"role": "user", "content": "ok"}]
    ids = conv.delta(observation)
    conv.observe(observation, ids)
    assert conv.drift_turns == 1
    assert tuple(conv.ids[:3]) == CODEC.encode("xyz")
    assert TOKENIZER.decode(list(ids)) == "user: ok\nassistant: "  # the new messages' part of the rendering


def test_text_prompts_concatenate_contents():
    prompt = Prompt(id=0, text="2+2=", token_ids=CODEC.encode("2+2="))
    conv = Conversation(CODEC, prompt)
    conv.add_model(turn("4", eos=False))
    observation = [{"role": "user", "content": " right"}]
    conv.observe(observation, conv.delta(observation))
    assert TOKENIZER.decode(list(conv.context)) == "2+2=4 right"
    assert conv.drift_turns == 0
