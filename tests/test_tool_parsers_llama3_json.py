"""llama3_json tool parser: parser-semantics.md V-T21, V-T23, V-T24, ``;``-separated calls, splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_tool_parsers_common import ARG_TEXT, args_of, assert_split_invariant, names_of, parse, parse_chunks


def test_v_t21_single_call_no_content():
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco"}}')
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "San Francisco"}', "id": None}]


def test_v_t23_text_before_json_is_content_as_vllm_streams_it():
    # vLLM batch finds the call anywhere (and loses the prefix); its stream treats it as content.
    # We are the fold of the stream: content, no call (docs/tool_parsers.md).
    text = 'Sure! {"name": "get_weather", "parameters": {"city": "SF"}}'
    r = parse("llama3_json", text)
    assert r.content == text and r.calls == []


def test_v_t24_non_ascii_arguments_stay_literal_and_json_equal():
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "東京"}}')
    assert r.calls[0]["arguments"] == '{"city": "東京"}'
    assert args_of(r) == [{"city": "\u6771\u4eac"}]


def test_python_tag_and_semicolon_separated_calls():
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    r = parse("llama3_json", text)
    assert r.content is None
    assert names_of(r) == ["get_time", "get_weather"] and args_of(r) == [{}, {"city": "Oslo"}]


def test_leading_whitespace_before_the_object_is_allowed():
    assert names_of(parse("llama3_json", '\n {"name": "get_time", "parameters": {}}')) == ["get_time"]


def test_json_answer_without_name_is_content():
    text = '{"answer": 42, "note": "not a call"}'
    assert parse("llama3_json", text).content == text


def test_text_after_the_calls_is_content():
    # the whitespace right after a call is layout, the prose is the model's
    r = parse("llama3_json", '{"name": "get_time", "parameters": {}} and then some prose')
    assert r.content == "and then some prose" and names_of(r) == ["get_time"]


def test_malformed_arguments_close_and_the_rest_is_content():
    # the stream used to end with arguments that do not parse
    text = '{"name": "get_weather", "parameters": {"city": "Paris", oops}} more'
    r = parse("llama3_json", text)
    assert args_of(r) == [{"city": "Paris"}] and r.content == "oops}} more"
    assert parse_chunks("llama3_json", list(text)) == r
    r = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par')
    assert args_of(r) == [{"city": "Par"}]


def test_truncated_before_the_name_is_content():
    text = '{"name": "get_we'
    assert parse("llama3_json", text).content == text


def test_deeply_nested_arguments_parse():
    # vLLM's batch regex allows one nesting level only; the scanner has no such limit
    args = {"a": {"b": {"c": {"d": [1, {"e": "}"}]}}}}
    text = json.dumps({"name": "f", "parameters": args})
    assert args_of(parse("llama3_json", text)) == [args]


def test_one_character_per_feed_equals_one_feed():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x; {y}"}}; {"name": "b", "parameters": {}}'
    assert parse_chunks("llama3_json", list(text)) == parse("llama3_json", text)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(ARG_TEXT, st.integers(), st.none()), max_size=3), min_size=1, max_size=3),
    st.booleans(),
    st.lists(st.integers(0, 300), max_size=25),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, python_tag, cuts):
    text = ("<|python_tag|>" if python_tag else "") + "; ".join(
        json.dumps({"name": f"f{i}", "parameters": a}, ensure_ascii=i % 2 == 0) for i, a in enumerate(calls)
    )
    whole = assert_split_invariant("llama3_json", text, cuts)
    assert args_of(whole) == calls and whole.content is None
