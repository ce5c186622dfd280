"""The Hermes / Qwen tool-call format (workers.envs.toolcalls) on hand-written strings: the
rendered prompt pieces, parsing a finished completion, and the streaming parser fed one
character (or one odd-sized piece) at a time."""

from __future__ import annotations

import json
import re

import pytest

from workers.envs.toolcalls import (
    ToolCallStream,
    call_text,
    forced_prefix,
    parse_completion,
    text_messages,
    tools_prompt,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _stream(text: str, size: int, max_calls: int | None = None):
    """Feed `text` in pieces of `size` characters; return (content, calls, deltas)."""
    parser = ToolCallStream(max_calls)
    deltas = []
    for i in range(0, len(text), size):
        deltas += parser.push(text[i : i + size])
    deltas += parser.finish()
    return "".join(d.content or "" for d in deltas if d.call is None), parser.calls, deltas


def test_a_call_block_becomes_a_call_with_json_string_arguments():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           "\n</tool_call>"
    content, calls = parse_completion(text)
    assert content == "Let me look."
    [call] = calls
    assert call.name == "get_weather"
    assert call.arguments == '{"city": "Oslo"}'  # a JSON text, as OpenAI sends it
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.as_openai() == {"id": call.id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_only_calls_give_null_content_and_parallel_calls_keep_their_order():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>\n')
    content, calls = parse_completion(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": [1, 2]}')]
    assert calls[0].id != calls[1].id
    # parallel_tool_calls: false keeps the first; the second stays in the content as written
    content, calls = parse_completion(text, max_calls=1)
    assert [c.name for c in calls] == ["a"]
    assert content == '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>\n'


@pytest.mark.parametrize("block", [
    '{"name": "f", "arguments": {"x": 1}',  # unbalanced
    "not json at all",
    '{"arguments": {"x": 1}}',  # no name
    '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
    '["f", {}]',
])
def test_a_malformed_block_is_left_as_content(block):
    text = f"Sure.\n<tool_call>\n{block}\n</tool_call> done"
    assert parse_completion(text) == (text, [])


def test_text_without_blocks_is_unchanged_and_arguments_as_a_json_string_are_accepted():
    assert parse_completion("  plain answer \n") == ("  plain answer \n", [])
    assert parse_completion("a < b and <tool_") == ("a < b and <tool_", [])
    content, [call] = parse_completion(
        '<tool_call>{"name": "f", "arguments": "{\\"k\\": true}"}</tool_call>')
    assert content is None and call.arguments == '{"k": true}'


def test_an_unclosed_final_block_counts_only_when_it_holds_a_whole_call():
    content, [call] = parse_completion('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content is None and call.arguments == '{"a": 1}'
    cut = 'ok <tool_call>\n{"name": "f", "argu'
    assert parse_completion(cut) == (cut, [])


def test_streaming_matches_the_finished_parse_piece_by_piece():
    text = ('Checking both.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "bad"\n</tool_call>\n'
            ' and more <tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>')
    want_content, want_calls = parse_completion(text)
    for size in (1, 2, 3, 7, len(text)):
        content, calls, deltas = _stream(text, size)
        assert content == want_content, size
        assert [(c.name, c.arguments) for c in calls] == \
            [(c.name, c.arguments) for c in want_calls]
        # content never shows any part of a tag that opened a call
        assert "<tool_call>\n{\"name\": \"get_weather\"" not in content
        # each call: a header delta (id, type, name, empty arguments), then its arguments
        heads = [d.as_openai() for d in deltas if d.call is not None]
        assert heads[0] == {"tool_calls": [{"index": 0, "id": calls[0].id, "type": "function",
                                            "function": {"name": "get_weather",
                                                         "arguments": ""}}]}
        assert heads[1] == {"tool_calls": [{"index": 0, "function": {
            "arguments": '{"city": "Oslo"}'}}]}
        assert [h["tool_calls"][0]["index"] for h in heads] == [0, 0, 1, 1]
    # the malformed block came back as content, as written
    assert want_content == ('Checking both.<tool_call>\n{"name": "bad"\n</tool_call>\n'
                            " and more")


def test_streaming_holds_a_partial_tag_but_not_other_text():
    parser = ToolCallStream()
    assert [d.content for d in parser.push("x <tool")] == ["x"]  # " <tool" may open a call
    assert [d.content for d in parser.push("box")] == [" <toolbox"]  # it did not
    assert parser.push("\n<tool_call>\n{") == []  # inside a block: nothing yet
    deltas = parser.push('"name": "f", "arguments": {}}</tool_call>')
    assert [d.call.name for d in deltas] == ["f", "f"]
    assert parser.finish() == []
    assert parser.content() == "x <toolbox"


def test_streamed_text_without_calls_is_sent_exactly():
    text = "  spaces \n\n kept <tool_ and < all \n"
    for size in (1, 4):
        content, calls, _ = _stream(text, size)
        assert content == text and calls == []


def test_tools_are_offered_in_the_system_prompt_and_history_is_rendered():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    out = text_messages(messages, [WEATHER])
    system = out[0][1]
    assert out[0][0] == "system" and system.startswith("Be brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in system
    assert out[2] == ("assistant",
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                      '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                      '{"city": "Rome"}}\n</tool_call>')
    assert out[3:] == [("tool", "<tool_response>\nrain\n</tool_response>"),
                       ("tool", "<tool_response>\nsun\n</tool_response>")]
    # for chat templates without tool support: results are user turns, consecutive ones merged
    merged = text_messages(messages, None, tool_role="user")
    assert merged[0] == ("system", "Be brief.")
    assert merged[3:] == [("user", "<tool_response>\nrain\n</tool_response>\n"
                                   "<tool_response>\nsun\n</tool_response>")]
    # no system message: the tools block becomes one
    assert text_messages([{"role": "user", "content": "hi"}], [WEATHER])[0] == \
        ("system", tools_prompt([WEATHER]))


def test_forced_prefixes_make_the_model_continue_a_call():
    assert forced_prefix("auto", True) == "" and forced_prefix("none", True) == ""
    assert forced_prefix("required", False) == ""  # nothing offered, nothing forced
    assert forced_prefix("required", True) == "<tool_call>\n"
    named = forced_prefix("get_weather", True)
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    # the prefix plus a completion that finishes the call parses as that call
    content, [call] = parse_completion(named + '{"city": "Oslo"}}\n</tool_call>')
    assert content is None and call.name == "get_weather"
    assert call_text("f", '{"a": 1}') == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}' \
                                         "\n</tool_call>"
