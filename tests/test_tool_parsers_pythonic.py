"""pythonic tool parser: Python-literal calls to JSON arguments, string values streamed, splits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers.tools_pythonic import decode_python_string_body, python_string_safe_end
from tests.test_tool_parsers_common import (
    ARG_TEXT,
    args_of,
    assert_split_invariant,
    names_of,
    parse,
    parse_chunks,
    run_pieces,
)


def test_two_calls_with_literal_arguments():
    r = parse("pythonic", "[get_weather(city='Paris', days=3, metric=True), get_time()]")
    assert r.content is None
    assert r.calls == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "metric": true}', "id": None},
        {"name": "get_time", "arguments": "{}", "id": None},
    ]


def test_nested_literals_none_tuples_and_negative_numbers():
    r = parse("pythonic", "[f(a=[1, 'x)', {'k': (1, 2)}], b=None, c=-2.5)]")
    assert args_of(r) == [{"a": [1, "x)", {"k": [1, 2]}], "b": None, "c": -2.5}]


def test_string_escapes_decode_to_json_and_stream_before_the_quote_closes():
    pieces = run_pieces("pythonic", ["[send(text='東京 \\'q\\' \\n \\x41\\u00e9\\N{BULLET}", " more"])[:-1]
    streamed = "".join(p.arguments or "" for p in pieces)  # before finish closes the cut call
    assert streamed == '{"text": "東京 \'q\' \\n Aé• more'


def test_triple_quoted_and_double_quoted_strings():
    r = parse("pythonic", '[f(a=\'\'\'tri\'ple\'\'\', b="x\\"y", c=\'\')]')
    assert args_of(r) == [{"a": "tri'ple", "b": 'x"y', "c": ""}]


def test_list_of_non_calls_is_content():
    for text in ("[1, 2, 3]", "  [see above]", "[]"):
        r = parse("pythonic", text)
        assert r.content == text and r.calls == []


def test_leading_text_means_content():
    text = "Sure: [f(a=1)]"
    assert parse("pythonic", text).content == text


def test_text_after_the_list_is_content():
    # the whitespace right after the list is layout, the rest is the model's
    r = parse("pythonic", "[get_time()] and more")
    assert r.content == "and more" and names_of(r) == ["get_time"]


def test_positional_arguments_close_the_call_and_the_rest_is_content():
    r = parse("pythonic", "[f(a=1, 2)]")
    assert names_of(r) == ["f"] and args_of(r) == [{"a": 1}] and r.content == "2)]"


# --- numbers JSON cannot hold --------------------------------------------------------------------------


def test_non_finite_numbers_are_kept_as_text_not_infinity():
    r = parse("pythonic", "[f(big=1e999, neg=-1e999, ok=1.5)]")
    assert r.calls[0]["arguments"] == '{"big": "1e999", "neg": "-1e999", "ok": 1.5}'
    assert args_of(r) == [{"big": "1e999", "neg": "-1e999", "ok": 1.5}]  # strict JSON: no Infinity


def test_a_bytes_literal_does_not_drop_the_calls_after_it():
    r = parse("pythonic", "[f(data=b'\\x00ab', tags={1, 2}), g(x=1)]")
    assert names_of(r) == ["f", "g"]
    assert args_of(r) == [{"data": "b'\\x00ab'", "tags": "{1, 2}"}, {"x": 1}]


def test_a_call_cut_by_max_tokens_is_closed():
    for text, args in (("[f(a='abc", {"a": "abc"}), ("[f(a=[1, 2", {"a": "[1, 2"}), ("[f(a=1, b=", {"a": 1}),
                       ("[f(a=12", {"a": 12}), ("[f(", {})):
        assert args_of(parse("pythonic", text)) == [args], text


def test_python_string_safe_end_never_splits_an_escape():
    assert python_string_safe_end("ab\\") == 2
    assert python_string_safe_end("ab\\x4") == 2
    assert python_string_safe_end("ab\\x41") == 6
    assert python_string_safe_end("ab\\N{BUL") == 2
    assert python_string_safe_end("ab\\1") == 2
    assert python_string_safe_end("ab\\\\") == 4
    assert decode_python_string_body("\\101\\t\\q") == "A\t\\q"


def test_one_character_per_feed_equals_one_feed():
    text = "[get_weather(city='New \\'York\\'', days=3), run(code=\"if x: {'a': [1]}\")]"
    assert parse_chunks("pythonic", list(text)) == parse("pythonic", text)


PY_VALUES = st.one_of(ARG_TEXT, st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False), st.lists(st.integers(), max_size=3), st.dictionaries(st.sampled_from(["k", "v"]), ARG_TEXT, max_size=2))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(["city", "q", "n", "code"]), PY_VALUES, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(0, 400), max_size=30),
)
def test_property_random_splits_give_the_same_calls_as_one_feed(calls, cuts):
    text = "[" + ", ".join(f"f{i}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for i, a in enumerate(calls)) + "]"
    whole = assert_split_invariant("pythonic", text, cuts)
    assert args_of(whole) == calls and whole.content is None
