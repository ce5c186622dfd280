"""Tool calling through the official `openai` client against the real server and a tiny
Qwen3-MoE. A random model does not write tool calls by itself, so its tokenizer gets one extra
token whose text is a whole call block, and `logit_bias` makes the model sample it: the
server's own sampling, parsing and response assembly then run end to end. The tokenizer is
trained on a corpus holding every printable ASCII character, so a rendered prompt decodes
back to its exact text."""

from __future__ import annotations

import json
import string

import openai
import pytest

from tests.workers.inference.conftest import save_tiny_policy
from workers.envs.toolcalls import forced_prefix, text_messages, tools_prompt
from workers.inference.engine import Batcher, SamplingParams, plain_chat
from workers.rl.objectives import build_objective
from workers.rl.spec import ArithmeticSpec, TinyMoeSpec
from workers.rl.tokenizer import train_bpe

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Overrides conftest's: the same tiny policy, its tokenizer knowing the call token."""
    corpus = [*build_objective(ArithmeticSpec()).corpus(), string.printable,
              tools_prompt([WEATHER])]
    tok = train_bpe(corpus, vocab_size=256)
    tok.add_tokens([CALL])
    # room for the tools block in the system prompt
    return save_tiny_policy(tmp_path_factory.mktemp("policy-tools"), tok,
                            TinyMoeSpec(num_layers=2, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def call_id(policy):
    return policy.tok.convert_tokens_to_ids(CALL)


def _prompt(policy, response) -> str:
    return policy.tok.decode(response.model_extra["prompt_token_ids"])


def test_a_sampled_call_block_comes_back_as_tool_calls(client, policy, call_id):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=2, temperature=0,
        logit_bias={str(call_id): 100}, extra_body={"return_token_ids": True})
    [choice] = r.choices
    assert choice.model_extra["token_ids"] == [call_id, call_id]  # the bias forced it twice
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather")] * 2
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}] * 2
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert r.usage.completion_tokens == 2
    # the tools were offered in the system prompt, in the plain chat format this model uses
    assert _prompt(policy, r) == plain_chat(text_messages(ASK, [WEATHER]))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in _prompt(policy, r)

    single = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=2, temperature=0,
        logit_bias={str(call_id): 100}, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in single.message.tool_calls] == ["get_weather"]
    assert single.message.content == CALL  # the second block stays text


def test_without_tools_offered_the_same_text_is_plain_content(client, policy, call_id):
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 2, "temperature": 0,
          "logit_bias": {str(call_id): 100}, "extra_body": {"return_token_ids": True}}
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = client.chat.completions.create(**kw, **extra)
        [choice] = r.choices
        assert choice.message.content == CALL + CALL, extra
        assert choice.message.tool_calls is None and choice.finish_reason == "length"
        assert "<tools>" not in _prompt(policy, r)  # "none": the tools are not offered


def test_streamed_tool_calls_arrive_as_deltas_and_accumulate(client, call_id):
    kw = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "max_tokens": 2,
          "temperature": 0, "logit_bias": {str(call_id): 100}}
    full = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""  # no piece of a call block leaks into the content
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.id is not None, d.function.name, d.function.arguments)
            for d in deltas] == [(0, True, "get_weather", ""), (0, False, None,
                                                                '{"city": "Oslo"}'),
                                 (1, True, "get_weather", ""), (1, False, None,
                                                                '{"city": "Oslo"}')]
    assert deltas[0].type == "function"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:  # the SDK's accumulator
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot.choices[0]
    assert [(c.function.name, c.function.arguments) for c in snapshot.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert snapshot.finish_reason == "tool_calls"


def test_a_history_with_calls_and_results_is_accepted_and_rendered(client, policy, call_id):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0,
        logit_bias={str(call_id): 100}).choices[0].message
    [call] = first.tool_calls
    history = [*ASK, first.model_dump(exclude_none=True),  # the client's own message object
               {"role": "tool", "tool_call_id": call.id, "content": "rain, 4 C"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                       max_tokens=3, extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = _prompt(policy, r)
    assert prompt == plain_chat(text_messages(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
         {"role": "tool", "content": "rain, 4 C"}], [WEATHER]))
    assert prompt.endswith(f"assistant: {CALL}\ntool: <tool_response>\nrain, 4 C\n"
                           "</tool_response>\nassistant:")


def test_a_named_tool_choice_starts_the_call_and_invents_none(client, policy, call_id):
    """The prompt ends inside a call to the named function. The biased token then makes the
    block malformed: it comes back as content, as written, and no call is made up."""
    prefix = forced_prefix("get_weather", True)
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logit_bias={str(call_id): 100}, extra_body={"return_token_ids": True})
    assert _prompt(policy, r).endswith("assistant:" + prefix)
    [choice] = r.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content == prefix + CALL


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "get_time"}}},
         "tool_choice.function.name", "'get_time', which is not in tools"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
         "messages.2.tool_call_id", "no earlier assistant message made"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]},
         "messages.2.tool_call_id", "no tool_call_id"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}]},
         "tools.0.function.parameters", "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                                                      "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters", "of type 'object'"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "two functions named"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
         "tools.0.function.name", "should match pattern"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages.0.tool_calls.0.function.arguments", "JSON object encoded as a string"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls", "only assistant messages carry tool_calls"),
        ({"logit_bias": {"99999": 5}}, "logit_bias", "outside this model's vocabulary"),
    ],
)
def test_bad_tool_requests_get_clear_400s(client, extra, param, fragment):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{k: v for k, v in body.items()
                                          if k in ("model", "messages")},
                                       extra_body={k: v for k, v in body.items()
                                                   if k not in ("model", "messages")})
    error = err.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"], error["message"]


def test_logit_bias_steers_the_static_engine_too(policy, call_id):
    """The merging `Batcher` (models the continuous scheduler does not serve) applies the
    same bias: -100 on every token but two leaves only those two to sample."""
    allowed = {call_id, policy.tok.eos_token_id}
    bias = tuple((t, -100.0) for t in range(policy.vocab_size) if t not in allowed)
    batcher = Batcher(policy, max_rows=8)
    try:
        [samples] = batcher.submit(["1+1="], 4, SamplingParams(1.0, 1.0, 3, logit_bias=bias),
                                   seed=1).result(60)
    finally:
        batcher.close()
    assert all(set(s.token_ids) <= allowed for s in samples)
