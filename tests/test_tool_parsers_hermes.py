"""hermes tool parser: parser-semantics.md §6.2 vectors, and stream == batch for every split."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from render_service.parsers.base import ToolCallPiece
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_tool_parsers_common import (
    ARG_TEXT,
    args_of,
    assert_split_invariant,
    names_of,
    parse,
    parse_chunks,
    run_pieces,
)

QWEN3_TOKENIZER = str(QWEN3_FIXTURE_DIR / "tokenizer.json")


def call(name, args_json):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_json}}}\n</tool_call>'


V_T01 = call("get_weather", '{"city": "Paris"}')
V_T02 = "I'll check both cities.\n" + V_T01 + "\n" + call("get_weather", '{"city": "Tokyo"}')


def test_single_call_has_no_content_and_raw_arguments():
    r = parse("hermes", V_T01)
    assert r.content is None
    assert names_of(r) == ["get_weather"]
    assert r.calls[0]["arguments"] == '{"city": "Paris"}'


def test_v_t02_content_before_two_calls_and_nothing_between():
    r = parse("hermes", V_T02)
    assert r.content == "I'll check both cities.\n"  # N profile: the "\n" between calls is not content
    assert names_of(r) == ["get_weather", "get_weather"]
    assert args_of(r) == [{"city": "Paris"}, {"city": "Tokyo"}]


def test_v_t02_second_call_first_fragment_carries_its_name():
    pieces = [p for p in run_pieces("hermes", list(V_T02)) if isinstance(p, ToolCallPiece)]
    firsts = {}
    for p in pieces:
        firsts.setdefault(p.index, p)
    assert firsts[0].name == "get_weather" and firsts[1].name == "get_weather"


def test_v_t03_missing_brace_keeps_the_streamed_call():
    # vLLM batch drops the call and returns the raw text; its stream emits the call. We are the fold of the
    # stream (docs/tool_parsers.md): one call, whose arguments object was complete.
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    r = parse("hermes", text)
    assert r.content is None
    assert names_of(r) == ["get_weather"] and args_of(r) == [{"city": "Paris"}]


def test_v_t05_braces_inside_string_values():
    text = call("run", json.dumps({"code": "if (x) { return '}'; }"}))
    r = parse("hermes", text)
    assert r.calls[0]["arguments"] == '{"code": "if (x) { return \'}\'; }"}'
    for i in range(len(text)):  # a lone "}" token inside the string is never dropped
        assert parse_chunks("hermes", [text[:i], text[i:]]) == r


def test_v_t06_closing_tag_inside_a_string_value_is_text():
    # vLLM as released truncates this call (vllm#45167); we follow the fix (string-aware scan).
    text = call("write_file", '{"path": "a.md", "content": "Use </tool_call> to close."}')
    r = parse("hermes", text)
    assert names_of(r) == ["write_file"]
    assert args_of(r) == [{"path": "a.md", "content": "Use </tool_call> to close."}]


def test_v_t08_non_ascii_and_emoji_stay_literal():
    text = call("send", '{"text": "東京 😀"}')
    assert parse("hermes", text).calls[0]["arguments"] == '{"text": "東京 😀"}'


def test_v_t08_real_qwen3_tokens_one_at_a_time_never_carry_replacement_chars():
    tok = Tokenizer.from_file(QWEN3_TOKENIZER)
    text = call("send", '{"text": "東京 😀 𝄞 🇯🇵 ẞ"}')
    ids = tok.encode(text).ids
    stream = DecodeStream(skip_special_tokens=False)
    chunks = [s for s in (stream.step(tok, i) for i in ids) if s]
    assert "".join(chunks) == text
    pieces = run_pieces("hermes", chunks)
    for p in pieces:
        assert "\ufffd" not in (getattr(p, "arguments", None) or getattr(p, "text", "") or "")
    assert args_of(parse_chunks("hermes", chunks)) == [{"text": "東京 😀 𝄞 🇯🇵 ẞ"}]


def test_v_t09_model_written_unicode_escapes_are_json_equal():
    text = call("get_weather", '{"city": "\\u6771\\u4eac"}')
    r = parse("hermes", text)
    assert r.calls[0]["arguments"] == '{"city": "\\u6771\\u4eac"}'  # raw, like vLLM N streaming
    assert args_of(r) == [{"city": "東京"}]


def test_v_t11_arguments_serialised_as_a_string_are_decoded_once():
    text = '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>'
    r = parse("hermes", text)
    assert r.calls[0]["arguments"] == '{"param": "max_connections"}'
    for i in range(len(text)):
        assert parse_chunks("hermes", [text[:i], text[i:]]) == r


def test_arguments_that_are_not_an_object_give_empty_arguments_and_content():
    # never hand out arguments that are not a JSON object. The name went out when it was complete
    # (vLLM's chunking) and is never taken back: the call gets {} and the model's value is content.
    for args, content in (('"hello"', '"hello"'), ("[1, 2]", "[1, 2]"), ("42", "42")):
        text = f'<tool_call>\n{{"name": "send", "arguments": {args}}}\n</tool_call>'
        r = parse("hermes", text)
        assert names_of(r) == ["send"] and args_of(r) == [{}] and r.content == content
        assert parse_chunks("hermes", list(text)) == r


def test_string_arguments_that_look_like_json_but_are_not_stay_valid():
    # "{hello world}" / "[oops" used to be emitted verbatim (invalid JSON)
    r = parse("hermes", '<tool_call>\n{"name": "send", "arguments": "{hello world}"}\n</tool_call>')
    assert names_of(r) == ["send"] and args_of(r) == [{}]
    assert r.content == "hello world}"  # what could not be arguments is content, not lost
    r = parse("hermes", '<tool_call>\n{"name": "send", "arguments": "[oops"}\n</tool_call>')
    assert args_of(r) == [{}] and r.content == '"[oops"'
    r = parse("hermes", '<tool_call>\n{"name": "send", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>')
    assert args_of(r) == [{"text": "hi"}]  # a string holding an object is still decoded once (V-T11)


def test_v_t12_whitespace_before_the_call_is_content():
    # what the qwen3 reasoning parser hands on after "</think>"
    r = parse("hermes", "\n\n" + V_T01)
    assert r.content == "\n\n" and args_of(r) == [{"city": "Paris"}]


def test_v_c04_text_after_a_complete_call_is_content():
    # nothing the model wrote is lost; the whitespace right after a call is layout
    r = parse("hermes", V_T01 + "\nAlso")
    assert r.content == "Also" and args_of(r) == [{"city": "Paris"}]
    r = parse("hermes", "A " + V_T01 + "\n between \n" + V_T01 + "\n")
    assert r.content == "A between \n" and len(r.calls) == 2


def test_call_without_arguments_gets_empty_object():
    r = parse("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>')
    assert r.calls == [{"name": "get_time", "arguments": "{}", "id": None}]


def test_arguments_before_name_are_held_until_the_name_is_known():
    r = parse("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>')
    assert names_of(r) == ["get_weather"] and args_of(r) == [{"city": "Oslo"}]


def test_parameters_key_and_nested_values():
    args = {"a": [1, {"b": [True, None, 2.5e-3]}], "s": "x\\y\"z"}
    text = '<tool_call>\n{"name": "f", "parameters": ' + json.dumps(args) + "}\n</tool_call>"
    assert args_of(parse("hermes", text)) == [args]


def test_non_json_body_is_returned_as_content():
    text = "<tool_call>\nnot json\n</tool_call> after"
    assert parse("hermes", text).content == text and parse("hermes", text).calls == []


def test_object_without_name_is_returned_as_content():
    text = 'Look: <tool_call>{"foo": {"bar": 1}}</tool_call>'
    r = parse("hermes", text)
    assert r.content == text and r.calls == []


def test_truncated_before_name_flushes_raw_text_as_content():
    text = 'ok <tool_call>\n{"name": "get_wea'
    r = parse("hermes", text)
    assert r.content == text and r.calls == []


def test_truncated_inside_arguments_is_closed():
    # a call cut by max_tokens still ends with a JSON object (the open string and object closed)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    r = parse("hermes", text)
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Par"}', "id": None}]
    # a member cut before its value: the object closes without it, the model's text is content
    r = parse("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "da')
    assert args_of(r) == [{"city": "Paris"}] and r.content == ', "da'


def test_partial_start_tag_at_the_end_is_released_as_content():
    assert parse("hermes", "see <tool_c").content == "see <tool_c"


def test_unclosed_final_call_still_parses():
    r = parse("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert args_of(r) == [{}]


def test_repeated_start_tag_opens_one_call():
    r = parse("hermes", '<tool_call><tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert names_of(r) == ["get_time"] and args_of(r) == [{}]


def test_next_call_without_closing_tag_starts_a_new_call():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call>'
    r = parse("hermes", text)
    assert names_of(r) == ["a", "b"] and args_of(r) == [{"x": 1}, {"y": 2}]


def test_missing_inner_brace_ends_at_closing_tag_with_truncated_arguments():
    text = '<tool_call>{"name": "a", "arguments": {"x": [1, 2}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    r = parse("hermes", text)
    assert names_of(r) == ["a", "b"]
    assert r.calls[1]["arguments"] == "{}"


def test_one_character_per_feed_equals_one_feed():
    text = "Sure.\n" + V_T02[len("I'll check both cities.\n") :] + "\ntrailing"
    assert parse_chunks("hermes", list(text)) == parse("hermes", text)


def test_state_stays_small_while_long_arguments_stream():
    import msgspec

    from render_service.parsers.base import ToolParserConfig
    from render_service.parsers.tools_hermes import HermesToolParser

    parser = HermesToolParser(ToolParserConfig())
    state = parser.initial_state()
    parser.feed(state, '<tool_call>\n{"name": "write_file", "arguments": {"content": "')
    streamed = 0
    for _ in range(2000):
        for p in parser.feed(state, "lorem </tool_call> ipsum } { "):
            streamed += len(p.arguments or "")
        assert len(msgspec.msgpack.encode(state)) < 200
    assert streamed == 2000 * len("lorem </tool_call> ipsum } { ")


@st.composite
def hermes_outputs(draw):
    prefix = draw(st.text(max_size=20).filter(lambda s: "<tool_call>" not in s))
    n = draw(st.integers(0, 3))
    calls = []
    text = prefix
    for i in range(n):
        args = draw(st.dictionaries(st.sampled_from(["city", "q", "text", "n"]), st.one_of(ARG_TEXT, st.integers(), st.booleans(), st.none(), st.lists(ARG_TEXT, max_size=3)), max_size=3))
        calls.append((f"f{i}", args))
        body = json.dumps({"name": f"f{i}", "arguments": args}, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))
        text += "<tool_call>\n" + body + "\n</tool_call>" + draw(st.sampled_from(["", "\n", "\n\n"]))
    return text, prefix, calls


@settings(max_examples=150, deadline=None)
@given(hermes_outputs(), st.lists(st.integers(0, 400), max_size=30))
def test_property_random_splits_give_the_same_calls_as_one_feed(output, cuts):
    text, prefix, calls = output
    whole = assert_split_invariant("hermes", text, cuts)
    assert names_of(whole) == [c[0] for c in calls]
    assert args_of(whole) == [c[1] for c in calls]
    assert whole.content == (prefix or None)
