"""Shared helpers for the tool-parser tests, and tests of the shared machinery in tools_common."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers.base import TextPiece, ToolCallPiece, ToolParserConfig, ToolSpec
from render_service.parsers.json_scan import JsonScan, json_string_safe_end, scan_json_value
from render_service.parsers.registry import get_tool_parser, tool_parser_names
from render_service.parsers.response_template import bind_parser
from render_service.parsers.tags import find_tag, partial_tag_len
from tests.family_bundles import GEMMA4_TEMPLATE_METADATA

WEATHER_TOOLS = ToolParserConfig(
    tools=[
        ToolSpec(
            name="get_weather",
            parameters={
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
                "required": ["city"],
            },
        ),
        ToolSpec(name="get_time", parameters={"type": "object", "properties": {}}),
        ToolSpec(
            name="write_file",
            parameters={"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
        ),
        ToolSpec(name="send", parameters={"type": "object", "properties": {"text": {"type": "string"}}}),
        ToolSpec(name="run", parameters={"type": "object", "properties": {"code": {"type": "string"}}}),
    ]
)


class Folded(msgspec.Struct):
    """What a client reconstructs from the pieces: content (None if never sent) and each call in index order."""

    content: str | None
    calls: list[dict]
    reasoning: str | None = None  # Muse's tool stage routes reasoning messages too (without a reasoning stage)


def fold(pieces) -> Folded:
    content = reasoning = None
    calls: dict[int, dict] = {}
    for p in pieces:
        if isinstance(p, TextPiece) and p.channel == "reasoning":
            reasoning = (reasoning or "") + p.text
        elif isinstance(p, TextPiece):
            assert p.channel == "content"
            content = (content or "") + p.text
        else:
            assert isinstance(p, ToolCallPiece)
            call = calls.setdefault(p.index, {"name": None, "arguments": "", "id": None})
            if p.name is not None:
                assert call["name"] is None, "a call's name is sent exactly once"
                call["name"] = p.name
            else:
                assert call["name"] is not None, "a call's first fragment carries its name"
            if p.id is not None:
                call["id"] = p.id
            if p.arguments:
                call["arguments"] += p.arguments
    assert sorted(calls) == list(range(len(calls))), "call indexes are 0, 1, ... in order"
    return Folded(content, [calls[i] for i in sorted(calls)], reasoning)


def run_pieces(parser_name: str, chunks, config: ToolParserConfig = WEATHER_TOOLS, check_state=True):
    # hf/beam read the bundle's response_template: here Gemma 4's
    parser = bind_parser(get_tool_parser(parser_name), GEMMA4_TEMPLATE_METADATA)(config)
    state = parser.initial_state()
    pieces = []
    for chunk in chunks:
        pieces += parser.feed(state, chunk)
        if check_state:
            # the state must survive a stream_state round trip at every step
            raw = msgspec.msgpack.encode(state)
            state = msgspec.msgpack.decode(raw, type=type(state))
    pieces += parser.finish(state)
    return pieces


def parse(parser_name: str, text: str, config: ToolParserConfig = WEATHER_TOOLS) -> Folded:
    return fold(run_pieces(parser_name, [text], config))


def parse_chunks(parser_name: str, chunks, config: ToolParserConfig = WEATHER_TOOLS) -> Folded:
    return fold(run_pieces(parser_name, chunks, config))


def split_reasoning(parser, text: str) -> list[tuple[str, str]]:
    """A reasoning parser's (channel, text) runs for ``text``, checked equal when fed one character at a time."""

    def run(chunks: list[str]) -> list[tuple[str, str]]:
        state = parser.initial_state()
        out: list[list[str]] = []
        for p in [q for ch in chunks for q in parser.feed(state, ch)] + parser.finish(state):
            if out and out[-1][0] == p.channel:
                out[-1][1] += p.text
            else:
                out.append([p.channel, p.text])
        return [(c, t) for c, t in out]

    whole = run([text])
    assert run(list(text)) == whole  # streaming one character at a time == batch
    return whole


def split_at(text: str, cuts) -> list[str]:
    points = sorted(set(c for c in cuts if 0 < c < len(text)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def args_of(folded: Folded) -> list:
    return [json.loads(c["arguments"]) for c in folded.calls]


def names_of(folded: Folded) -> list:
    return [c["name"] for c in folded.calls]


def assert_split_invariant(parser_name: str, text: str, cuts, config: ToolParserConfig = WEATHER_TOOLS):
    whole = parse(parser_name, text, config)
    assert parse_chunks(parser_name, split_at(text, cuts), config) == whole
    return whole


# Unicode text for argument values: CJK, emoji (astral plane), quotes, backslashes, braces, newlines
ARG_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("ab {}[]\"'\\/\n\t<>:,;=()東京😀🇯🇵é")),
        st.characters(blacklist_categories=("Cs",)),
    ),
    max_size=24,
)


# ---------------------------------------------------------------------------------------------------------


def test_registry_knows_every_required_parser():
    for name in ("hermes", "qwen3_coder", "qwen3_xml", "llama3_json", "mistral", "deepseek_v31", "pythonic", "kimi_k2"):
        assert name in tool_parser_names()
        cls = get_tool_parser(name)
        parser = cls(ToolParserConfig())
        assert isinstance(parser.initial_state(), cls.State)


def test_registry_rejects_unknown_name_listing_known_ones():
    try:
        get_tool_parser("nope")
    except KeyError as e:
        assert "hermes" in str(e)
    else:
        raise AssertionError("unknown parser name accepted")


def test_find_tag_holds_back_partial_tag_suffix():
    assert find_tag("abc<tool_", 0, ("<tool_call>",)) == (3, None)
    assert find_tag("abc<tool_call>x", 0, ("<tool_call>",)) == (3, "<tool_call>")
    assert find_tag("abc<b", 0, ("<tool_call>",)) == (5, None)
    assert partial_tag_len("xx<", 0, ("<a>", "<bb>")) == 1


def test_json_scan_ends_value_across_chunks_ignoring_braces_in_strings():
    text = '{"code": "if (x) { return \'}\'; } \\" }"} tail'
    for cut in range(len(text)):
        scan = JsonScan()
        stop = scan_json_value(scan, text[:cut], 0, cut, False)
        if not scan.done:
            stop = scan_json_value(scan, text, stop, len(text), False)
        assert scan.done and text[:stop] == text[: text.index("} tail") + 1]


def test_json_string_safe_end_never_splits_escapes_or_surrogate_pairs():
    assert json_string_safe_end("ab\\") == 2
    assert json_string_safe_end("ab\\\\") == 4
    assert json_string_safe_end("ab\\u12") == 2
    assert json_string_safe_end("ab\\ud83d") == 2
    assert json_string_safe_end("ab\\ud83d\\ude00") == len("ab\\ud83d\\ude00")
    assert json_string_safe_end("ab\\n") == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 80), max_size=12))
def test_every_parser_passes_plain_text_through_any_split(cuts):
    text = "Plain answer, no tools: 東京 😀 {not a call} [or this] <b>bold</b>"
    for name in tool_parser_names():
        whole = parse(name, text)
        assert whole.calls == []
        assert parse_chunks(name, split_at(text, cuts)) == whole
        if name not in ("llama3_json", "pythonic"):
            assert whole.content == text


REALISTIC = {
    "hermes": 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\"aris", "n": [1, {"a": "}"}]}}\n</tool_call>',
    "qwen3_coder": "A<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "qwen3_xml": "<function=get_time>\n</function>",
    "llama3_json": '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "arguments": "{\\"y\\": 1}"}',
    "mistral": 'x [TOOL_CALLS] [{"name": "a", "arguments": {"q": 1}}][TOOL_CALLS]b[ARGS]{"y": "}"}',
    "deepseek_v31": "ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "pythonic": "[f(a='x\\'y', b=[1, (2, 3)], c=\"\"\"t\"\"\"), g()]",
    "kimi_k2": "r<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|> {\"a\": 1} <|tool_call_end|><|tool_calls_section_end|>",
}


def _mutate(value, draw):
    if isinstance(value, msgspec.Struct):
        for field in value.__struct_fields__:
            setattr(value, field, _mutate(getattr(value, field), draw))
        return value
    if not draw(st.booleans()):
        return value
    if isinstance(value, bool):
        return draw(st.booleans())
    if isinstance(value, int):
        return draw(st.integers(0, 14))
    if isinstance(value, str):
        parts = st.sampled_from(list("\\\"'{}[]()<>=,;:x \n|/") + ["<tool_call>", "</parameter>", "\\u12"])
        return "".join(draw(st.lists(parts, max_size=6)))
    return value


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(REALISTIC)), st.integers(0, 200), st.data())
def test_forged_state_is_rejected_or_handled_never_crashes(name, cut, data):
    """stream_state comes from clients: a state that decodes must never make a parser raise."""
    parser = get_tool_parser(name)(WEATHER_TOOLS)
    state = parser.initial_state()
    text = REALISTIC[name]
    parser.feed(state, text[: cut % (len(text) + 1)])
    raw = msgspec.to_builtins(_mutate(state, data.draw))
    try:
        state = msgspec.convert(raw, type(state))
    except msgspec.ValidationError:
        return
    parser.feed(state, data.draw(st.sampled_from(["", text, text[::-1], "x", "\\", "<", ")]}"])))
    parser.finish(state)


# a call opened up to the start of a long argument value, and a chunk of that value to repeat
LONG_ARGUMENT = {
    "hermes": ('<tool_call>\n{"name": "write_file", "arguments": {"content": "', 'x } { </tool_call> \\"\\" \\" 東 😀 '),
    "qwen3_coder": ("<tool_call>\n<function=write_file>\n<parameter=content>\n", "x } { </tool_call> </param \n 東 😀 "),
    "llama3_json": ('{"name": "write_file", "parameters": {"content": "', 'x } { ; \\" 東 😀 '),
    "mistral": ('[TOOL_CALLS]write_file{"content": "', 'x } { [TOOL_CALLS] \\" 東 😀 '),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>write_file<｜tool▁sep｜>{\"content\": \"", "x } { 東 😀 \n"),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0<|tool_call_argument_begin|>{\"content\": \"", "x } { 東 😀 "),
    "pythonic": ("[write_file(content='", "x } { ) ] \\' 東 😀 \\n"),
}


def test_long_arguments_stream_with_bounded_state():
    """No parser accumulates argument text: the state stays small and everything fed comes out at once."""
    for name, (opening, chunk) in LONG_ARGUMENT.items():
        parser = get_tool_parser(name)(WEATHER_TOOLS)
        state = parser.initial_state()
        parser.feed(state, opening)
        sent = 0
        for i in range(500):
            for c in (chunk[: i % len(chunk)], chunk[i % len(chunk) :]):
                pieces = parser.feed(state, c)
                sent += sum(len(p.arguments or "") for p in pieces if isinstance(p, ToolCallPiece))
            assert len(msgspec.msgpack.encode(state)) < 300, name
        assert sent >= 0.9 * 500 * len(chunk), name  # it all streamed (give or take escaping)


# the pieces each format is built from, tags and their fragments included: random sequences of these are
# mostly malformed, which is where hold-back and recovery bugs live
FORMAT_VOCABULARY = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "{", "}", "[", "]", '"', "\\", ":", ",", '"name"',
               '"arguments"', '"parameters"', '"f"', " ", "\n", "x", "1", "<", '\\"', "\\u00e9", "\\ud83d", "😀"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
                    "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "😀", "null"],
    "llama3_json": ["<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":", ",", ";", '"name"', '"parameters"',
                    '"f"', " ", "\n", "x", "1"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[", "]", "{", "}", '"', "\\", ":", ",", '"name"', '"arguments"', "f",
                " ", "x", "1"],
    "deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁calls▁end｜>", "<｜tool", "f", "{", "}", " ", "\n", "x"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|tool_call", "functions.f:0", ":", ".", "{",
                "}", " ", "\n", "x"],
    "pythonic": ["[", "]", "(", ")", "f", "g", "a", "=", "'", '"', "'''", "\\", ",", " ", "1", "None", "\\n",
                 "\\x4", "{", "}", "😀"],
}


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(sorted(FORMAT_VOCABULARY)), st.data())
def test_property_any_text_split_anywhere_gives_the_same_pieces(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FORMAT_VOCABULARY[name]), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    whole = parse(name, text)
    assert parse_chunks(name, split_at(text, cuts)) == whole
    assert parse_chunks(name, list(text)) == whole
