"""mistral tool parser: V-T26 (v11 ``[TOOL_CALLS]name{...}``), V-T27 (pre-v11 array), v13 ``[ARGS]``, splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_tool_parsers_common import ARG_TEXT, args_of, assert_split_invariant, names_of, parse, parse_chunks


def test_v_t26_v11_name_then_raw_arguments():
    r = parse("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}')
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}', "id": None}]


def test_v_t26_name_goes_out_before_the_arguments_finish():
    from tests.test_tool_parsers_common import run_pieces

    pieces = run_pieces("mistral", ["[TOOL_CALLS]get_weather{", '"city": "Pa'], check_state=False)[:2]
    assert pieces[0].name == "get_weather" and "".join(p.arguments or "" for p in pieces) == '{"city": "Pa'
    # cut there by max_tokens, the call still ends as a JSON object
    assert args_of(parse("mistral", '[TOOL_CALLS]get_weather{"city": "Pa')) == [{"city": "Pa"}]


def test_a_v11_name_without_object_arguments_is_content():
    for text in ("[TOOL_CALLS]get_weather[ARGS] not json", '[TOOL_CALLS]get_weather[ARGS]["x"]'):
        r = parse("mistral", text)
        assert r.calls == [] and r.content == text


def test_v_t27_pre_v11_array_with_content_before():
    text = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    r = parse("mistral", text)
    assert r.content == "Sure. "
    assert names_of(r) == ["get_weather", "get_time"] and args_of(r) == [{"city": "Paris"}, {}]


def test_v11_repeated_markers_and_v13_args_marker():
    r = parse("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time{}')
    assert names_of(r) == ["get_weather", "get_time"] and args_of(r) == [{"city": "Oslo"}, {}]


def test_braces_and_markers_inside_strings_do_not_end_arguments():
    args = {"code": "} [TOOL_CALLS] {", "nested": {"a": [1, 2]}}
    r = parse("mistral", "[TOOL_CALLS]run" + json.dumps(args))
    assert args_of(r) == [args]


def test_marker_followed_by_prose_is_content():
    text = "[TOOL_CALLS] sorry, no tool fits"
    assert parse("mistral", text).content == text


def test_text_after_calls_is_content():
    # the whitespace right after a call is layout, the rest is the model's text
    r = parse("mistral", 'Hi [TOOL_CALLS]get_time{} bye')
    assert r.content == "Hi bye" and names_of(r) == ["get_time"]
    r = parse("mistral", 'Hi [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]\nbye')
    assert r.content == "Hi bye" and names_of(r) == ["get_time"]


def test_truncated_marker_is_released_as_content():
    assert parse("mistral", "ok [TOOL_CAL").content == "ok [TOOL_CAL"


def test_one_character_per_feed_equals_one_feed():
    for text in ('A [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]',
                 '[TOOL_CALLS]a[ARGS]{"x": "}"}[TOOL_CALLS]b{"y": [1]}'):
        assert parse_chunks("mistral", list(text)) == parse("mistral", text)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(ARG_TEXT, st.integers(), st.booleans()), max_size=3), min_size=1, max_size=3),
    st.sampled_from(["v11", "v13", "array"]),
    st.text(max_size=10).filter(lambda s: "[" not in s),
    st.lists(st.integers(0, 300), max_size=25),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, form, prefix, cuts):
    if form == "array":
        body = " " + json.dumps([{"name": f"f{i}", "arguments": a} for i, a in enumerate(calls)], ensure_ascii=False)
        text = prefix + "[TOOL_CALLS]" + body
    else:
        sep = "[ARGS]" if form == "v13" else ""
        text = prefix + "".join(f"[TOOL_CALLS]f{i}{sep}" + json.dumps(a, ensure_ascii=False) for i, a in enumerate(calls))
    whole = assert_split_invariant("mistral", text, cuts)
    assert args_of(whole) == calls and names_of(whole) == [f"f{i}" for i in range(len(calls))]
    assert whole.content == (prefix or None)
