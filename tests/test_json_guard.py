"""json_guard: streamed JSON-text arguments stay a valid JSON object whatever the model writes."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers.json_guard import (
    GUARD_DONE,
    GUARD_ERROR,
    GUARD_MORE,
    ArgsGuard,
    close_guard,
    feed_guard,
)


def guard(chunks: list[str]) -> tuple[str, str, str]:
    """(arguments emitted and closed, text the guard dropped, input left after it stopped)."""
    g, out = ArgsGuard(), []
    for k, chunk in enumerate(chunks):
        g = msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=ArgsGuard)  # stream_state round trip
        stop, emitted, status = feed_guard(g, chunk, 0, len(chunk))
        out.append(emitted)
        if status != GUARD_MORE:
            rest = chunk[stop:] + "".join(chunks[k + 1:])
            closing, dropped = close_guard(g) if status == GUARD_ERROR else ("", "")
            return "".join(out) + closing, dropped, rest
    closing, dropped = close_guard(g)
    return "".join(out) + closing, dropped, ""


@pytest.mark.parametrize("text, args, dropped, rest", [
    ('{"a": [1, {"b": "x\\"}"}], "c": true}', '{"a": [1, {"b": "x\\"}"}], "c": true}', "", ""),
    ('{"a": 1} tail', '{"a": 1}', "", " tail"),
    ('{"city": "Par', '{"city": "Par"}', "", ""),  # cut inside a string
    ('{"a": 12', '{"a": 12}', "", ""),  # a number the output ended on is complete
    ('{"a": tr', "{}", '"a": tr', ""),  # a literal that is not one yet: content, not arguments
    ('{"a": 1, "da', '{"a": 1}', ', "da', ""),  # a member cut before its value
    ('{"a": 1,', '{"a": 1}', "", ""),  # a lone comma is markup
    ('{"a": "x\\u12', '{"a": "x"}', "\\u12", ""),  # an unfinished escape
    ('{"a": 1, oops}', '{"a": 1}', "", "oops}"),  # a syntax error: stop there
    ("{hello world}", "{}", "", "hello world}"),
    ("[1, 2]", "{}", "", "[1, 2]"),  # not an object
    ('{"a": 1,}', '{"a": 1}', "", ""),  # trailing comma repaired
    ('{"a": "line\nbreak\t"}', '{"a": "line\\nbreak\\t"}', "", ""),  # raw control characters escaped
    ('{"a": "\\q"}', '{"a": "\\\\q"}', "", ""),  # an invalid escape keeps its backslash, doubled
    ('{"a": "\\u12"zz"}', '{"a": "\\\\u12"}', "", 'zz"}'),
])
def test_vectors_in_one_feed_and_one_character_at_a_time(text, args, dropped, rest):
    assert guard([text]) == (args, dropped, rest)
    assert guard(list(text)) == (args, dropped, rest)
    assert isinstance(json.loads(args), dict)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4), st.booleans(), st.data())
def test_valid_objects_pass_through_byte_exact_and_any_cut_is_an_object(obj, indent, data):
    text = json.dumps(obj, ensure_ascii=data.draw(st.booleans()), indent=2 if indent else None)
    assert guard([text]) == (text, "", "")
    cut = text[: data.draw(st.integers(0, len(text)))]
    args, _, _ = guard([cut])
    assert isinstance(json.loads(args), dict)
    if cut:
        assert args.startswith(cut[: len(cut) - 1024]) or len(cut) <= 1024  # only a bounded tail is held


@pytest.mark.parametrize("raw", [
    {"phase": 7},  # after a value, with no open container
    {"phase": 0, "stack": "{"},  # not started, yet an open object
    {"phase": 5, "stack": "{x"},
    {"phase": 6, "stack": "{", "pending": "1", "scalar_at": 5},
])
def test_inconsistent_client_states_are_refused(raw):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(raw, ArgsGuard)


def test_done_guard_reports_done_and_consumes_nothing():
    g = ArgsGuard()
    assert feed_guard(g, "{}", 0, 2)[2] == GUARD_DONE
    assert feed_guard(g, "x", 0, 1) == (0, "", GUARD_DONE)
