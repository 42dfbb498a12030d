"""kimi_k2 tool parser: the model's own ids ``functions.NAME:IDX``, V-T32's tool side, splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers.base import ToolParserConfig, ToolSpec
from tests.test_tool_parsers_common import (
    ARG_TEXT,
    args_of,
    assert_split_invariant,
    names_of,
    parse,
    parse_chunks,
    run_pieces,
)

SB, CB, AB, CE, SE = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"

V_T31 = f'{SB}{CB}functions.get_weather:0{AB}{{"city": "Beijing"}}{CE}{SE}'


def test_v_t31_id_is_the_models_own():
    r = parse("kimi_k2", V_T31)
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Beijing"}', "id": "functions.get_weather:0"}]


def test_id_rides_on_the_first_fragment_with_the_name():
    first = run_pieces("kimi_k2", list(V_T31))[0]
    assert first.name == "get_weather" and first.id == "functions.get_weather:0"


def test_v_t32_text_before_the_section_is_content_for_the_tool_parser():
    # With thinking on, the reasoning parser ends reasoning at the section marker and hands the tool parser
    # the text from the marker; with thinking off the tool parser sees everything: the text before the
    # section is content (kimi batch rule), the call is extracted either way.
    r = parse("kimi_k2", "I'll call the tool." + V_T31)
    assert r.content == "I'll call the tool." and names_of(r) == ["get_weather"]


def test_bare_name_without_functions_prefix_and_arguments_trimmed():
    r = parse("kimi_k2", f'{SB}{CB} get_time:3 {AB}  \n{{}}\n  {CE}{SE}')
    assert r.calls == [{"name": "get_time", "arguments": "{}", "id": "get_time:3"}]


def test_parallel_calls_keep_their_ids_and_indexes():
    text = f'{SB}{CB}functions.a:0{AB}{{"x": 1}}{CE}{CB}functions.b:1{AB}{{"y": "}}"}}{CE}{SE}'
    r = parse("kimi_k2", text)
    assert [c["id"] for c in r.calls] == ["functions.a:0", "functions.b:1"]
    assert args_of(r) == [{"x": 1}, {"y": "}"}]


def test_singular_section_marker_spelling():
    assert names_of(parse("kimi_k2", f"<|tool_call_section_begin|>{CB}functions.f:0{AB}{{}}{CE}")) == ["f"]


def test_trailing_whitespace_is_held_not_sent_until_more_arguments_come():
    pieces = run_pieces("kimi_k2", [f"{SB}{CB}functions.f:0{AB}", '{"a": 1', "  ", "}", f"  {CE}"])
    assert "".join(p.arguments or "" for p in pieces) == '{"a": 1  }'


def test_one_character_per_feed_equals_one_feed():
    text = "Sure." + V_T31.replace("Beijing", "北京 😀") + " bye"
    assert parse_chunks("kimi_k2", list(text)) == parse("kimi_k2", text)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q"]), st.one_of(ARG_TEXT, st.integers()), max_size=3), min_size=1, max_size=3),
    st.text(max_size=10).filter(lambda s: "<" not in s),
    st.lists(st.integers(0, 400), max_size=30),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, prefix, cuts):
    text = prefix + SB + "".join(f"{CB}functions.f{i}:{i}{AB}{json.dumps(a, ensure_ascii=False)}{CE}" for i, a in enumerate(calls)) + SE
    whole = assert_split_invariant("kimi_k2", text, cuts)
    assert args_of(whole) == calls and whole.content == (prefix or None)
    assert [c["id"] for c in whole.calls] == [f"functions.f{i}:{i}" for i in range(len(calls))]


# --- ids that are not functions.NAME:IDX -------------------------------------------------

ONE_TOOL = ToolParserConfig(tools=[ToolSpec(name="get_weather", parameters={"type": "object"})])
TWO_TOOLS = ToolParserConfig(tools=[ToolSpec(name="get_weather"), ToolSpec(name="get_time")])


def _call(call_id: str) -> str:
    return f'{SB}{CB}{call_id}{AB}{{"city": "Oslo"}}{CE}{SE}'


def test_a_bare_counter_takes_the_only_tools_name_and_keeps_its_text_as_the_id():
    r = parse("kimi_k2", _call("0"), ONE_TOOL)
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}', "id": "0"}]


def test_an_empty_id_of_the_only_tool_is_written_in_the_models_style():
    r = parse("kimi_k2", _call(" "), ONE_TOOL)
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}', "id": "functions.get_weather:0"}]


def test_a_malformed_id_naming_a_declared_tool_takes_that_name_and_keeps_its_text():
    # the id is what the model wrote: nothing of it is lost, and a later turn renders the call as generated
    for call_id in ("functions.get_time.0", "functions.get_time:0x", "functions.get_time:0:functions.get_time:0"):
        r = parse("kimi_k2", _call(call_id), TWO_TOOLS)
        assert names_of(r) == ["get_time"] and r.calls[0]["id"] == call_id


def test_an_ambiguous_id_is_content_never_a_call_named_0():
    for call_id, tools in (("0", TWO_TOOLS), ("functions.x.0", TWO_TOOLS), ("functions.x.0", ONE_TOOL)):
        text = "Hi " + _call(call_id)
        r = parse("kimi_k2", text, tools)
        assert r.calls == [], call_id
        assert r.content == f'Hi {CB}{call_id}{AB}{{"city": "Oslo"}}{CE}'
