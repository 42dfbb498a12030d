"""qwen3_coder tool parser (on the XML engine shared with qwen3_xml): values typed by the whole schema, value
boundaries that survive a literal ``</parameter>``, text after calls, cut-off calls, streaming, splits."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers import tool_schema
from render_service.parsers.base import ToolParserConfig, ToolSpec
from render_service.parsers.pipeline import native_forced_tool_choice
from render_service.parsers.tools_qwen3_coder import Qwen3CoderToolParser
from tests.test_tool_parsers_common import (
    ARG_TEXT,
    WEATHER_TOOLS,
    args_of,
    assert_split_invariant,
    names_of,
    parse,
    parse_chunks,
)

V_T15 = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


def test_v_t15_typed_parameters_convert_by_schema_byte_exact():
    r = parse("qwen3_coder", V_T15)
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "New York", "days": 3, "metric": true}', "id": None}]


def test_qwen3_xml_agrees_on_well_formed_calls():
    # qwen3_xml is its own parser (tools_qwen3_xml.py); on well-formed calls the two agree byte for byte
    assert parse("qwen3_xml", V_T15) == parse("qwen3_coder", V_T15)


def test_v_t17_parameter_missing_from_schema_stays_a_string():
    tools = ToolParserConfig(tools=[ToolSpec(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}, "metric": {"type": "boolean"}}})])
    assert args_of(parse("qwen3_coder", V_T15, tools)) == [{"city": "New York", "days": "3", "metric": True}]


def test_v_t17_request_without_tools_gives_strings_everywhere():
    assert args_of(parse("qwen3_coder", V_T15, ToolParserConfig())) == [{"city": "New York", "days": "3", "metric": "true"}]


def test_v_t18_content_before_call_and_empty_arguments():
    r = parse("qwen3_coder", "Checking.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert r.content == "Checking.\n"
    assert r.calls == [{"name": "get_time", "arguments": "{}", "id": None}]


def test_exactly_one_leading_and_trailing_newline_is_stripped():
    text = "<tool_call>\n<function=send>\n<parameter=text>\n\n  two lines\n  kept\n\n</parameter>\n</function>\n</tool_call>"
    assert args_of(parse("qwen3_coder", text)) == [{"text": "\n  two lines\n  kept\n"}]


def test_string_value_streams_before_its_closing_tag():
    parser = Qwen3CoderToolParser(WEATHER_TOOLS)
    state = parser.initial_state()
    parser.feed(state, "<tool_call>\n<function=write_file>\n<parameter=content>\n")
    pieces = parser.feed(state, 'line "one" \\ 東京\nline two')
    streamed = "".join(p.arguments or "" for p in pieces)
    assert streamed == 'line \\"one\\" \\\\ 東京\\nline two'
    assert len(msgspec.msgpack.encode(state)) < 200


def _convert(text, schema):
    return tool_schema.convert(text, tool_schema.schema_types(schema))


def test_convert_value_rules():
    assert _convert("42", {"type": "integer"}) == 42
    assert _convert("4x", {"type": "integer"}) == "4x"
    assert _convert("3.0", {"type": "number"}) == 3 and isinstance(_convert("3.0", {"type": "number"}), int)
    assert _convert("2.5", {"type": "number"}) == 2.5
    assert _convert("True", {"type": "boolean"}) is True
    assert _convert("yes", {"type": "boolean"}) == "yes"  # not silently False: the model's text is kept
    assert _convert('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert json.dumps(_convert("{'a': (1, 2)}", {"type": "object"})) == '{"a": [1, 2]}'
    assert _convert("[oops", {"type": "array"}) == "[oops"
    assert _convert("null", {"type": "integer"}) == "null"  # null only where the schema allows it
    assert _convert("None", {"type": ["object", "null"]}) is None
    assert _convert("null", {"type": "string"}) == "null"
    assert _convert("null", {"type": "string", "nullable": True}) is None
    assert _convert("1e999", {"type": "number"}) == "1e999"  # Infinity is not JSON


def test_nullable_and_union_types_from_schema():
    tools = ToolParserConfig(tools=[ToolSpec(name="f", parameters={"properties": {"a": {"type": ["integer", "null"]}, "b": {"type": ["string", "null"]}, "c": {"type": "array"}}})])
    text = "<tool_call>\n<function=f>\n<parameter=a>\nnull\n</parameter>\n<parameter=b>\nnull\n</parameter>\n<parameter=c>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    assert args_of(parse("qwen3_coder", text, tools)) == [{"a": None, "b": None, "c": [1, 2]}]


def test_text_between_and_after_calls_is_content():
    one = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    r = parse("qwen3_coder", "A" + one + "\nmid\n" + one.replace("get_time", "get_weather") + "\nDone.")
    assert r.content == "Amid\nDone." and names_of(r) == ["get_time", "get_weather"]


def test_bare_function_block_without_tool_call_tag_parses():
    r = parse("qwen3_coder", "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>")
    assert args_of(r) == [{"city": "Oslo"}]


def test_tool_call_tag_not_followed_by_function_is_content():
    text = "Use <tool_call> syntax like this."
    assert parse("qwen3_coder", text).content == text


def test_truncated_before_function_name_flushes_as_content():
    text = "Hi <tool_call>\n<function=get_wea"
    r = parse("qwen3_coder", text)
    assert r.content == text and r.calls == []


def test_truncated_inside_value_is_closed_with_what_was_written():
    r = parse("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo")
    assert r.calls[0]["arguments"] == '{"city": "New Yo"}'
    r = parse("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n1")
    assert args_of(r) == [{"days": 1}]


def test_missing_function_end_closed_by_tool_call_end():
    r = parse("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</tool_call>")
    assert args_of(r) == [{"city": "Oslo"}]


def test_one_character_per_feed_equals_one_feed():
    text = "Let me look.\n" + V_T15 + "\n" + V_T15
    assert parse_chunks("qwen3_coder", list(text)) == parse("qwen3_coder", text)


PARAM_VALUES = st.one_of(
    ARG_TEXT.map(lambda s: ("city", s, s)),
    st.integers(-10**6, 10**6).map(lambda i: ("days", str(i), i)),
    st.booleans().map(lambda b: ("metric", str(b).lower(), b)),
    ARG_TEXT.map(lambda s: ("note", s, s)),  # not in the schema
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(PARAM_VALUES, max_size=4, unique_by=lambda p: p[0]), max_size=3), st.text(max_size=10).filter(lambda s: "<" not in s), st.lists(st.integers(0, 500), max_size=30))
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, prefix, cuts):
    text = prefix
    expected = []
    for params in calls:
        text += "<tool_call>\n<function=get_weather>\n"
        args = {}
        for key, raw, value in params:
            text += f"<parameter={key}>\n{raw}\n</parameter>\n"
            args[key] = value
        text += "</function>\n</tool_call>\n"
        expected.append(args)
    whole = assert_split_invariant("qwen3_coder", text, cuts)
    assert args_of(whole) == expected
    assert whole.content == (prefix or None)
    for c in whole.calls:  # byte-exact: what vLLM's batch json.dumps would give
        assert c["arguments"] == json.dumps(json.loads(c["arguments"]), ensure_ascii=False)


def test_missing_function_end_closed_by_the_next_call():
    text = "<tool_call>\n<function=get_time>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    r = parse("qwen3_coder", text)
    assert names_of(r) == ["get_time", "get_weather"] and args_of(r) == [{}, {"city": "Oslo"}]


# --- values typed by the whole schema (what Pydantic emits) ----------------------------

PYDANTIC_TOOL = ToolParserConfig(tools=[ToolSpec(name="f", parameters={
    "type": "object",
    "properties": {
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},  # Optional[int]
        "names": {"type": "array", "items": {"type": "string"}},  # list[str]
        "extra": {"type": "object", "additionalProperties": True},  # dict[str, Any]
        "ratio": {"type": ["number", "null"]},
        "mode": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # Optional[str]
    },
})])


def _call(params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


def test_optional_int_is_a_number_and_null_is_null():
    assert args_of(parse("qwen3_coder", _call([("limit", "5")]), PYDANTIC_TOOL)) == [{"limit": 5}]
    assert args_of(parse("qwen3_coder", _call([("limit", "None")]), PYDANTIC_TOOL)) == [{"limit": None}]
    assert args_of(parse("qwen3_coder", _call([("note", "null")]), PYDANTIC_TOOL)) == [{"note": None}]
    assert args_of(parse("qwen3_coder", _call([("note", "5")]), PYDANTIC_TOOL)) == [{"note": "5"}]


def test_arrays_objects_and_json_strings_holding_objects_convert():
    params = [("names", '["a", "b"]'), ("extra", '{"k": [1, {"z": null}]}'), ("ratio", "0.5"), ("mode", "3")]
    assert args_of(parse("qwen3_coder", _call(params), PYDANTIC_TOOL)) == [
        {"names": ["a", "b"], "extra": {"k": [1, {"z": None}]}, "ratio": 0.5, "mode": 3}]
    # a JSON string holding the object, as models sometimes double-encode
    quoted = [("extra", '"{\\"k\\": 1}"')]
    assert args_of(parse("qwen3_coder", _call(quoted), PYDANTIC_TOOL)) == [{"extra": {"k": 1}}]
    # a value that does not fit is kept as the model's text, never lost
    assert args_of(parse("qwen3_coder", _call([("names", "[oops")]), PYDANTIC_TOOL)) == [{"names": "[oops"}]


# --- value boundaries ---------------------------------------------------------------


def test_a_literal_end_tag_inside_a_value_stays_in_the_value():
    source = 'end = "</parameter>"\nif x:\n    emit("</parameter>")'
    text = _call([("content", source), ("path", "p.py")]).replace("<function=f>", "<function=write_file>")
    r = parse("qwen3_coder", text)
    assert args_of(r) == [{"content": source, "path": "p.py"}]  # no spurious parameters, no duplicate keys
    assert parse_chunks("qwen3_coder", list(text)) == r


def test_a_value_missing_its_end_tag_is_recovered_at_function_end():
    text = "<tool_call>\n<function=send>\n<parameter=text>\nhello\n</function>\n</tool_call>"
    assert args_of(parse("qwen3_coder", text)) == [{"text": "hello"}]
    assert parse("qwen3_coder", text).content is None


def test_forced_tool_choice_keeps_the_json_grammar_path():
    assert not native_forced_tool_choice("qwen3_coder", "required")
    assert native_forced_tool_choice("qwen3_xml", "required")
