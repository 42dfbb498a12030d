"""glm45 / glm47, minimax_m2, seed_oss, qwen3_xml: the XML-call families on tools_xml's engine.

Vectors state each family's format and upstream rule; property tests (hypothesis) check, over generated and
adversarial outputs, cut anywhere (max_tokens mid-call included) and split at every point or one character
at a time: batch == fold of the stream, every call's arguments are a JSON object equal to the concatenated
deltas, and nothing generated is lost (every character outside markup and layout whitespace is in content,
a name, a key or a value).
"""

from __future__ import annotations

import collections
import json
import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers import tool_schema
from render_service.parsers.base import ToolCallPiece, ToolParserConfig, ToolSpec
from render_service.parsers.registry import get_tool_parser
from tests.test_tool_parsers_common import (
    ARG_TEXT,
    WEATHER_TOOLS,
    _mutate,
    args_of,
    names_of,
    parse,
    parse_chunks,
    run_pieces,
    split_at,
)

FAMILIES = ("glm45", "glm47", "minimax_m2", "seed_oss", "qwen3_xml")


def write_call(family: str, name: str, params: list[tuple[str, str]]) -> str:
    """A call as the family's model writes it (its chat template's own layout)."""
    if family == "glm45":
        body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params)
        return f"<tool_call>{name}\n{body}</tool_call>"
    if family == "glm47":
        body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in params)
        return f"<tool_call>{name}{body}</tool_call>"
    if family == "minimax_m2":
        body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
        return f'<minimax:tool_call>\n<invoke name="{name}">\n{body}</invoke>\n</minimax:tool_call>'
    if family == "seed_oss":
        body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params)
        return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# the markup of each family: removed before checking that nothing else was lost
MARKUP = {
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", "</invoke>",
                   "<parameter name=", "</parameter>", ">", '"'],
    "seed_oss": ["<seed:tool_call>", "</seed:tool_call>", "<function=", "</function>", "<parameter=",
                 "</parameter>", ">"],
    "qwen3_xml": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">"],
}
MARKUP["glm47"] = MARKUP["glm45"]


def _letters(text: str) -> collections.Counter:
    return collections.Counter(c for c in text.casefold() if c.isalnum())


def assert_nothing_lost(family: str, text: str, folded) -> None:
    raw = text
    for tag in sorted(MARKUP[family], key=len, reverse=True):
        raw = raw.replace(tag, " ")
    seen = [folded.content or ""]
    for call in folded.calls:
        seen.append(call["name"])
        for key, value in json.loads(call["arguments"], object_pairs_hook=list):
            seen.append(key)
            seen.append(value if isinstance(value, str) else json.dumps(value))
    missing = _letters(raw) - _letters(" ".join(seen))
    assert not missing, f"lost {dict(missing)} of {text!r} -> {folded}"


def assert_arguments_are_objects(folded) -> None:
    for call in folded.calls:
        assert isinstance(json.loads(call["arguments"]), dict), call


def check_all(family: str, text: str, config: ToolParserConfig = WEATHER_TOOLS, cuts=()):
    whole = parse(family, text, config)
    assert parse_chunks(family, split_at(text, cuts), config) == whole
    assert parse_chunks(family, list(text), config) == whole
    assert_arguments_are_objects(whole)
    assert_nothing_lost(family, text, whole)
    return whole


# --- vectors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_content_then_a_typed_call_then_text(family):
    text = "Checking. " + write_call(family, "get_weather", [("city", "Paris"), ("days", "3"), ("metric", "true")])
    text += "\nDone, it is sunny."
    r = check_all(family, text)
    assert names_of(r) == ["get_weather"]
    assert args_of(r) == [{"city": "Paris", "days": 3, "metric": True}]
    # text after the call is content (nothing lost); the whitespace right after a call is layout
    assert r.content == "Checking. Done, it is sunny."


@pytest.mark.parametrize("family", FAMILIES)
def test_arguments_bytes_are_json_dumps_of_the_values(family):
    r = parse(family, write_call(family, "get_weather", [("city", '東京 "x" \\ 😀'), ("days", "3")]))
    assert r.calls[0]["arguments"] == json.dumps({"city": '東京 "x" \\ 😀', "days": 3}, ensure_ascii=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_calls_and_a_call_without_arguments(family):
    text = write_call(family, "get_time", []) + "\n" + write_call(family, "get_weather", [("city", "Oslo")])
    r = check_all(family, text)
    assert names_of(r) == ["get_time", "get_weather"]
    assert args_of(r) == [{}, {"city": "Oslo"}]
    assert r.content is None


def test_minimax_several_invokes_in_one_block_and_single_quotes():
    text = ("<minimax:tool_call>\n<invoke name='get_time'>\n</invoke>\n<invoke name=get_weather>\n"
            "<parameter name='city'>\n  Rome \n</parameter>\n</invoke>\n</minimax:tool_call>")
    r = check_all("minimax_m2", text)
    assert names_of(r) == ["get_time", "get_weather"]
    assert args_of(r) == [{}, {"city": "Rome"}]  # upstream strips MiniMax values


def test_glm_string_values_keep_whitespace_typed_values_are_stripped():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York\n</arg_value>\n" \
           "<arg_key>days</arg_key>\n<arg_value> 3 </arg_value>\n</tool_call>"
    assert args_of(check_all("glm45", text)) == [{"city": " New York\n", "days": 3}]


def test_glm_undeclared_parameters_are_literals_when_they_parse():
    text = "<tool_call>anything\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n<arg_key>xs</arg_key>\n" \
           "<arg_value>[1, 'a']</arg_value>\n<arg_key>s</arg_key>\n<arg_value>hello</arg_value>\n</tool_call>"
    assert args_of(check_all("glm45", text, ToolParserConfig())) == [{"n": 5, "xs": [1, "a"], "s": "hello"}]


def test_glm47_literal_backslash_n_between_key_and_value_is_layout():
    text = "<tool_call>get_weather<arg_key>city</arg_key>\\n<arg_value>Oslo</arg_value></tool_call>"
    assert args_of(parse("glm47", text)) == [{"city": "Oslo"}]


@pytest.mark.parametrize("family", ("seed_oss", "qwen3_xml", "minimax_m2"))
def test_undeclared_parameters_stay_strings(family):
    r = parse(family, write_call(family, "get_weather", [("zip", "75001")]))
    assert args_of(r) == [{"zip": "75001"}]


SCHEMA_TOOL = ToolParserConfig(tools=[ToolSpec(name="f", parameters={"type": "object", "properties": {
    "opt_int": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "int_or_str": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "listed": {"type": ["number", "null"]},
    "nullable_str": {"type": "string", "nullable": True},
    "tags": {"type": "array", "items": {"type": "string"}},
    "meta": {"type": "object", "additionalProperties": True},
    "shape": {"properties": {"a": {"type": "integer"}}},
    "flag": {"type": "boolean"},
    "choice": {"enum": [1, 2, 3]},
    "big": {"type": "number"},
}})])


@pytest.mark.parametrize("family", FAMILIES)
def test_values_are_typed_by_the_whole_schema(family):
    params = [("opt_int", "5"), ("int_or_str", "7"), ("listed", "null"), ("nullable_str", "null"),
              ("tags", '["a", "b"]'), ("meta", '"{\\"k\\": 1}"'), ("shape", "{'a': 1}"), ("flag", "False"),
              ("choice", "2"), ("big", "1e999")]
    (args,) = args_of(check_all(family, write_call(family, "f", params), SCHEMA_TOOL))
    assert args == {"opt_int": 5, "int_or_str": 7, "listed": None, "nullable_str": None, "tags": ["a", "b"],
                    "meta": {"k": 1}, "shape": {"a": 1}, "flag": False, "choice": 2, "big": "1e999"}


def test_schema_types_reads_composites():
    assert tool_schema.schema_types({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == {"integer", "null"}
    assert tool_schema.schema_types({"type": ["string", "null"]}) == {"string", "null"}
    assert tool_schema.schema_types({"items": {}}) == {"array"}
    assert tool_schema.schema_types({}) == frozenset()
    assert tool_schema.convert("x", frozenset({"integer"})) == "x"  # never lost: the raw text
    assert tool_schema.convert("nope", frozenset({"integer", "null"})) == "nope"
    assert tool_schema.convert("2.5", frozenset({"integer", "number"})) == 2.5


@pytest.mark.parametrize("family", ("seed_oss", "qwen3_xml", "minimax_m2", "glm45"))
def test_a_literal_end_tag_inside_a_value_stays_in_the_value(family):
    end = "</arg_value>" if family == "glm45" else "</parameter>"
    value = f"<x>a{end} and {end}b</x>"
    (args,) = args_of(check_all(family, write_call(family, "write_file", [("content", value), ("path", "p")])))
    assert args == {"content": value, "path": "p"}


@pytest.mark.parametrize("family", ("seed_oss", "qwen3_xml", "minimax_m2"))
def test_a_value_missing_its_end_tag_is_closed_by_the_call_end(family):
    text = write_call(family, "send", [("text", "hello")]).replace("</parameter>", "", 1)
    (args,) = args_of(check_all(family, text))
    assert list(args) == ["text"] and args["text"].strip() == "hello"  # the layout newline may stay


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_inside_a_value_closes_the_call_with_what_was_written(family):
    text = write_call(family, "get_weather", [("city", "Reykjavik"), ("days", "3")])
    cut = text[: text.index("Reykjavik") + 4]
    r = check_all(family, cut)
    assert args_of(r) == [{"city": "Reyk"}]


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_inside_the_name_is_content(family):
    text = write_call(family, "get_weather", [("city", "Oslo")])
    cut = text[: text.index("get_weather") + 3]
    r = check_all(family, "Hi " + cut)
    assert r.calls == []
    assert r.content == "Hi " + cut


@pytest.mark.parametrize("family", FAMILIES)
def test_an_opener_that_is_not_a_call_is_content(family):
    opener = {"glm45": "<tool_call>", "glm47": "<tool_call>", "minimax_m2": "<minimax:tool_call>",
              "seed_oss": "<seed:tool_call>", "qwen3_xml": "<tool_call>"}[family]
    text = f"The tag {opener} <b>is</b> how calls start."
    r = check_all(family, text)
    assert r.calls == [] and r.content == text
    if family.startswith("glm"):
        # released as soon as the text cannot be a name, not after a wait
        parser = get_tool_parser(family)(WEATHER_TOOLS)
        pieces = parser.feed(parser.initial_state(), f"The tag {opener} <b>is")
        assert "".join(p.text for p in pieces if not isinstance(p, ToolCallPiece)).startswith(f"The tag {opener} ")


def test_qwen3_xml_agrees_with_qwen3_coder_on_well_formed_calls():
    v_t15 = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")
    assert parse("qwen3_xml", v_t15) == parse("qwen3_coder", v_t15)
    assert args_of(parse("qwen3_xml", "<function=get_time>\n</function>")) == [{}]


@pytest.mark.parametrize("family", FAMILIES)
def test_string_values_stream_before_their_end_tag(family):
    parser = get_tool_parser(family)(WEATHER_TOOLS)
    state = parser.initial_state()
    opening = write_call(family, "write_file", [("content", "\x00")]).split("\x00")[0]
    parser.feed(state, opening)
    pieces = parser.feed(state, "line one, then more ")
    streamed = "".join(p.arguments or "" for p in pieces if isinstance(p, ToolCallPiece))
    assert "line one, then more" in streamed
    assert len(msgspec.msgpack.encode(state)) < 300


# --- properties --------------------------------------------------------------------------------------------

VALUE_TEXT = st.one_of(
    ARG_TEXT,
    st.sampled_from(["3", "true", "null", "Oslo", " spaced ", "a</parameter>b", "x</arg_value>y", "<parameter=q>",
                     "</function>", "</invoke>", "\n\nlines\n\n", "{\"a\": [1, 2]}", "😀东京"]),
)
PARAM = st.tuples(st.sampled_from(["city", "days", "metric", "content", "path", "unit", "extra"]), VALUE_TEXT)
CALL = st.tuples(st.sampled_from(["get_weather", "write_file", "get_time", "unknown_tool"]),
                 st.lists(PARAM, max_size=3, unique_by=lambda p: p[0]))
PROSE = st.text(alphabet=st.sampled_from(list("Ok, sure. 東😀\n<>/=")), max_size=12)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(FAMILIES), PROSE, st.lists(CALL, min_size=1, max_size=3), PROSE,
       st.floats(0, 1), st.lists(st.integers(0, 400), max_size=12))
def test_property_generated_outputs_cut_anywhere_keep_both_invariants(family, before, calls, after, cut, cuts):
    text = before + "\n".join(write_call(family, name, params) for name, params in calls) + after
    text = text[: int(len(text) * cut)] if cut < 0.5 else text  # half the outputs are cut by max_tokens
    check_all(family, text, cuts=cuts)


PLAIN = st.text(alphabet=st.sampled_from(list("abcXYZ 0123")), min_size=1, max_size=8).filter(lambda s: s.strip())


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(FAMILIES), st.lists(st.tuples(st.just("write_file"),
       st.lists(st.tuples(st.sampled_from(["content", "path"]), PLAIN), max_size=3, unique_by=lambda p: p[0])),
       min_size=1, max_size=3))
def test_property_well_formed_string_calls_round_trip_exactly(family, calls):
    text = "\n".join(write_call(family, name, params) for name, params in calls)
    r = check_all(family, text)
    assert names_of(r) == [name for name, _ in calls]
    strip = str.strip if family == "minimax_m2" else (lambda s: s)
    assert args_of(r) == [{k: strip(v) for k, v in params} for _, params in calls]


VOCABULARY = {
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_",
              "</arg_", "get_weather", "city", "days", "\n", " ", "x", "3", "<", ">", "null", "😀"],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", "</invoke>",
                   "<parameter name=", "</parameter>", '"get_weather"', "'city'", "days", ">", "\n", " ", "x",
                   "3", "<", "<minimax:", "</param", "😀"],
    "seed_oss": ["<seed:tool_call>", "</seed:tool_call>", "<function=", "</function>", "<parameter=",
                 "</parameter>", "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "<seed:", "😀"],
    "qwen3_xml": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                  "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "</param", "null", "😀"],
}
VOCABULARY["glm47"] = VOCABULARY["glm45"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FAMILIES), st.data())
def test_property_adversarial_token_soup_keeps_both_invariants(family, data):
    text = "".join(data.draw(st.lists(st.sampled_from(VOCABULARY[family]), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    check_all(family, text, cuts=cuts)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FAMILIES), st.integers(0, 300), st.data())
def test_forged_state_is_rejected_or_handled_never_crashes(family, cut, data):
    parser = get_tool_parser(family)(WEATHER_TOOLS)
    state = parser.initial_state()
    text = write_call(family, "get_weather", [("city", "Oslo"), ("days", "3")])
    parser.feed(state, text[: cut % (len(text) + 1)])
    raw = msgspec.to_builtins(_mutate(state, data.draw))
    try:
        state = msgspec.convert(raw, type(state))
    except msgspec.ValidationError:
        return
    parser.feed(state, data.draw(st.sampled_from(["", text, text[::-1], "x", "<", "</parameter>\n"])))
    parser.finish(state)


@pytest.mark.parametrize("family", FAMILIES)
def test_long_string_value_streams_with_bounded_state(family):
    parser = get_tool_parser(family)(WEATHER_TOOLS)
    state = parser.initial_state()
    opening = write_call(family, "write_file", [("content", "\x00")]).split("\x00")[0]
    parser.feed(state, opening)
    chunk = "x } { </param <tool_ \n 東 😀 "
    sent = 0
    for i in range(300):
        for c in (chunk[: i % len(chunk)], chunk[i % len(chunk):]):
            pieces = parser.feed(state, c)
            sent += sum(len(p.arguments or "") for p in pieces if isinstance(p, ToolCallPiece))
        assert len(msgspec.msgpack.encode(state)) < 300
    assert sent >= 0.9 * 300 * len(chunk)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stored_state_round_trips_mid_call(family):
    text = "pre " + write_call(family, "get_weather", [("city", "Oslo"), ("days", "3")]) + " post"
    whole = run_pieces(family, [text])
    assert run_pieces(family, list(text), check_state=True) != [] and \
        parse_chunks(family, list(text)) == parse(family, text)
    assert whole


def test_registry_names_match_upstream():
    for family in FAMILIES:
        assert get_tool_parser(family).name == family
    assert re.fullmatch(r"[a-z0-9_]+", "minimax_m2")


@pytest.mark.parametrize("family", ("minimax_m2", "seed_oss", "qwen3_xml"))
def test_a_block_opener_followed_by_a_page_of_whitespace_is_content_in_every_chunking(family):
    opener = write_call(family, "get_time", []).split("\n")[0]
    text = opener + "\n" * 600 + write_call(family, "get_time", [])[len(opener):]
    r = check_all(family, text, cuts=[len(opener) + 100, len(opener) + 550])
    parser = get_tool_parser(family)(WEATHER_TOOLS)
    state = parser.initial_state()
    parser.feed(state, opener + "\n" * 600)
    assert len(msgspec.msgpack.encode(state)) < 1024  # the state stays bounded
    assert r.content is not None


def test_minimax_trailing_whitespace_hold_back_is_bounded_and_chunking_independent():
    text = write_call("minimax_m2", "send", [("text", "a" + " " * 200 + "b" + " " * 300)])
    r = check_all("minimax_m2", text, cuts=[40, 90, 260, 400])
    assert args_of(r) == [{"text": "a" + " " * 200 + "b" + " " * 236}]  # 64 trailing blanks are layout
    parser = get_tool_parser("minimax_m2")(WEATHER_TOOLS)
    state = parser.initial_state()
    parser.feed(state, text[: text.index("b") + 300])
    assert len(state.held) <= 64
