"""deepseek_v31 tool parser: V-T29, V-T30 (multi-line arguments: vLLM drops them, we keep them), splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_tool_parsers_common import ARG_TEXT, args_of, assert_split_invariant, names_of, parse, parse_chunks

B, CB, SEP, CE, E = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def test_v_t29_content_before_the_calls():
    r = parse("deepseek_v31", f'Let me check.{B}{CB}get_weather{SEP}{{"city": "Tokyo"}}{CE}{E}')
    assert r.content == "Let me check."
    assert r.calls == [{"name": "get_weather", "arguments": '{"city": "Tokyo"}', "id": None}]


def test_v_t30_multi_line_arguments_are_kept_raw():
    # vLLM's regex has no DOTALL and returns tool_calls [] here; the ideal (and ours) is the call, raw.
    r = parse("deepseek_v31", f'{B}{CB}get_weather{SEP}{{\n  "city": "Tokyo"\n}}{CE}{E}')
    assert r.content is None
    assert r.calls == [{"name": "get_weather", "arguments": '{\n  "city": "Tokyo"\n}', "id": None}]


def test_two_calls_and_text_after_section_is_content():
    # the whitespace right after the section is layout, the text is the model's
    r = parse("deepseek_v31", f"{B}{CB}a{SEP}{{}}{CE}\n{CB}b{SEP}{{\"x\": 1}}{CE}{E} done")
    assert names_of(r) == ["a", "b"] and args_of(r) == [{}, {"x": 1}]
    assert r.content == "done"


def test_empty_arguments_become_empty_object():
    assert parse("deepseek_v31", f"{B}{CB}get_time{SEP}{CE}{E}").calls[0]["arguments"] == "{}"


def test_call_without_section_marker_still_parses():
    assert names_of(parse("deepseek_v31", f"{CB}get_time{SEP}{{}}{CE}")) == ["get_time"]


def test_truncated_arguments_are_closed():
    assert parse("deepseek_v31", f'{B}{CB}get_weather{SEP}{{"city": "To').calls[0]["arguments"] == '{"city": "To"}'


# --- an unparsable block never disappears ---------------------------------------------


def test_arguments_that_are_not_an_object_give_empty_arguments_and_content():
    # the name went out at the separator and is never taken back: {} and the model's text as content
    r = parse("deepseek_v31", f"Sure.{B}{CB}get_weather{SEP}[1, 2]{CE}{E}")
    assert names_of(r) == ["get_weather"] and args_of(r) == [{}] and r.content == "Sure.[1, 2]"


def test_a_block_that_is_not_a_call_is_content_with_its_markers():
    for bad in (f"{CB}get_weather{CE}", f"{CB}get weather{{oops{CE}"):
        text = f"Sure.{B}{bad}{E}"
        r = parse("deepseek_v31", text)
        assert r.calls == [] and r.content == "Sure." + bad, bad
        assert parse_chunks("deepseek_v31", list(text)) == r


def test_a_section_with_only_prose_keeps_the_prose():
    # the case where the whole output used to vanish (content null)
    r = parse("deepseek_v31", f"{B}I cannot call a tool for that.")
    assert r.calls == [] and r.content == "I cannot call a tool for that."
    r = parse("deepseek_v31", f"{B}no call here{E} ok")
    assert r.content == "no call hereok"


def test_broken_arguments_close_and_the_rest_is_content():
    r = parse("deepseek_v31", f'{B}{CB}get_weather{SEP}{{"city": "Tokyo", oops}}{CE}{E}')
    assert args_of(r) == [{"city": "Tokyo"}] and r.content == "oops}"


def test_partial_marker_at_end_is_content():
    assert parse("deepseek_v31", "Hi <｜tool▁ca").content == "Hi <｜tool▁ca"


def test_one_character_per_feed_equals_one_feed():
    text = f'Hm.{B}{CB}get_weather{SEP}{{"city": "東京 😀"}}{CE}{CB}get_time{SEP}{{}}{CE}{E}'
    assert parse_chunks("deepseek_v31", list(text)) == parse("deepseek_v31", text)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q"]), st.one_of(ARG_TEXT, st.integers()), max_size=3), min_size=1, max_size=3),
    st.text(max_size=10).filter(lambda s: "<" not in s),
    st.sampled_from([None, 2]),
    st.lists(st.integers(0, 400), max_size=30),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, prefix, indent, cuts):
    text = prefix + B + "".join(f"{CB}f{i}{SEP}{json.dumps(a, ensure_ascii=False, indent=indent)}{CE}" for i, a in enumerate(calls)) + E
    whole = assert_split_invariant("deepseek_v31", text, cuts)
    assert args_of(whole) == calls and whole.content == (prefix or None)
