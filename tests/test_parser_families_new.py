"""The later parser families: kimi_k2 / deepseek_v4 / mistral / granite reasoning, deepseek_v32 / deepseek_v4 (DSML) /
granite4 / llama4_pythonic / llama4_json tool calls.

Vectors from upstream's behaviour (vLLM's parsers, read in the code stores) with our documented differences,
and hypothesis properties for the two invariants of the parser-hardening issue on every new tool parser:
arguments are always a JSON object at the end (outputs cut off anywhere included), and nothing the model wrote
is lost (its prose comes back as content), for every chunking (batch == fold of the stream).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.parsers.base import ReasoningParserConfig, TextPiece, ToolCallPiece, ToolParserConfig, ToolSpec
from render_service.parsers.registry import get_reasoning_parser, get_tool_parser
from tests.test_reasoning_parsers import run

DSML = "\uff5cDSML\uff5c"


def reasoning(name, **config):
    return get_reasoning_parser(name)(ReasoningParserConfig(**config))


TOOLS = [
    ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"},
        "metric": {"type": "boolean"}}}),
    ToolSpec(name="get_time", parameters={"type": "object", "properties": {}}),
]


def tools(name, specs=TOOLS):
    return get_tool_parser(name)(ToolParserConfig(tools=list(specs)))


def collect(parser, chunks) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client reconstructs them from the pieces."""
    state = parser.initial_state()
    pieces = []
    for c in chunks:
        pieces += parser.feed(state, c)
    pieces += parser.finish(state)
    content = "".join(p.text for p in pieces if isinstance(p, TextPiece))
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, ToolCallPiece):
            entry = calls.setdefault(p.index, ["", ""])
            if p.name is not None:
                assert entry[0] == "", "a name goes out once"
                entry[0] = p.name
            entry[1] += p.arguments or ""
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


# --- reasoning --------------------------------------------------------------------------------------------

def test_kimi_k2_think_block_and_the_implicit_end_at_a_tool_section():
    assert run(reasoning("kimi_k2"), ["<think>plan</think>answer"]) == ("plan", "answer")
    text = "<think>call it<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
    assert run(reasoning("kimi_k2"), [text]) == ("call it", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0")
    assert run(reasoning("kimi_k2"), list(text)) == run(reasoning("kimi_k2"), [text])
    # thinking is on unless the request says thinking: false (vLLM's kimi_k2 switch)
    cls = get_reasoning_parser("kimi_k2")
    assert cls.enable_thinking_from(None) is True and cls.enable_thinking_from({"thinking": False}) is False
    assert run(reasoning("kimi_k2", enable_thinking=False), ["<think>x</think>y"]) == (None, "<think>x</think>y")


def test_deepseek_v4_ends_reasoning_at_a_dsml_block_and_reads_both_switches():
    text = f"weighing it<{DSML}tool_calls>\n<{DSML}invoke name=\"f\">"
    assert run(reasoning("deepseek_v4"), [text]) == ("weighing it", text[len("weighing it"):])
    v32 = f"x</think>done<{DSML}function_calls>"
    assert run(reasoning("deepseek_v4"), [v32]) == ("x", f"done<{DSML}function_calls>")
    cls = get_reasoning_parser("deepseek_v4")
    assert cls.enable_thinking_from({"thinking": False}) is False
    assert cls.enable_thinking_from({"enable_thinking": False}) is False
    assert cls.enable_thinking_from({}) is True  # the prompt's tail (<think> / </think>) decides
    assert cls.enable_thinking_from({"reasoning_effort": "none"}) is False


def test_mistral_v_r16():
    p = "mistral"
    assert run(reasoning(p), ["[THINK]Check units.[/THINK]The answer is 5 km."]) == ("Check units.", "The answer is 5 km.")
    assert run(reasoning(p), ["[THINK]still thinking"]) == ("still thinking", None)
    assert run(reasoning(p), ["No think here"]) == (None, "No think here")
    assert run(reasoning(p), [""]) == (None, None)  # vLLM gives content "": empty is null here, as everywhere
    # text before [THINK] stays content; a stray [/THINK] before it is dropped; later tags are content
    assert run(reasoning(p), ["a[/THINK]b[THINK]r[/THINK]c[THINK]d"]) == ("r", "abc[THINK]d")


def test_granite_v_r18():
    p = "granite"
    text = "Here is my thought process:\nAdd them.\nHere is my response:\n4"
    assert run(reasoning(p), [text]) == ("\nAdd them.\n", "\n4")
    assert run(reasoning(p), list(text)) == ("\nAdd them.\n", "\n4")
    assert run(reasoning(p), ["Here's my thought process: a Here's my response: b"]) == (" a ", " b")
    # cut off before the response: reasoning (vLLM's stream; its batch says content)
    assert run(reasoning(p), ["Here is my thought process:\nstill going"]) == ("\nstill going", None)
    # not a thinking reply: all content, including phrases later on
    assert run(reasoning(p), ["Hi. Here is my response: x"]) == (None, "Hi. Here is my response: x")
    assert run(reasoning(p), ["Here is my res"]) == (None, "Here is my res")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["kimi_k2", "deepseek_v4", "mistral", "granite"]),
       st.lists(st.sampled_from(["<think>", "</think>", "[THINK]", "[/THINK]", "Here is my thought process:",
                                 "Here's my response:", "<|tool_calls_section_begin|>", f"<{DSML}tool_calls>",
                                 "<", "[", "H", "x", " ", "\n", "😀"]), max_size=16),
       st.lists(st.integers(0, 80), max_size=8))
def test_property_reasoning_any_split_gives_the_batch_answer(name, words, cuts):
    text = "".join(words)
    points = sorted({c for c in cuts if 0 < c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = run(reasoning(name), [text])
    assert run(reasoning(name), chunks) == whole
    assert run(reasoning(name), list(text)) == whole


# --- DSML (deepseek_v32 / deepseek_v4) --------------------------------------------------------------------

def dsml_call(name: str, params: list[tuple[str, bool, str]]) -> str:
    body = "".join(f"<{DSML}parameter name=\"{k}\" string=\"{'true' if s else 'false'}\">{v}</{DSML}parameter>\n"
                   for k, s, v in params)
    return f"<{DSML}invoke name=\"{name}\">\n{body}</{DSML}invoke>\n"


def dsml_block(version: str, calls: str) -> str:
    block = "tool_calls" if version == "deepseek_v4" else "function_calls"
    return f"<{DSML}{block}>\n{calls}</{DSML}{block}>"


@pytest.mark.parametrize("version", ["deepseek_v4", "deepseek_v32"])
def test_dsml_string_attribute_decides_how_a_value_reads(version):
    text = "Let me check.\n\n" + dsml_block(version, dsml_call("get_weather", [
        ("city", True, "杭州 \"quoted\"\n"), ("days", False, "5"), ("tags", False, '["a", 1]'),
        ("metric", False, "true"), ("note", False, "not json")]) + dsml_call("get_time", []))
    content, calls = collect(tools(version), [text])
    assert content == "Let me check.\n\n"
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "杭州 \"quoted\"\n", "days": 5, "tags": ["a", 1], "metric": True,
                                       "note": "not json"}
    assert calls[1][1] == "{}"
    assert collect(tools(version), list(text)) == (content, calls)


def test_dsml_the_schema_decides_declared_parameters_the_attribute_the_rest():
    # vLLM 0.33 coerces to the schema too: string="true" on an integer parameter still gives the integer
    text = dsml_block("deepseek_v4", dsml_call("get_weather", [("days", True, "5"), ("n", True, "5")]))
    assert json.loads(collect(tools("deepseek_v4"), [text])[1][0][1]) == {"days": 5, "n": "5"}
    # no attribute reads as string="false" (upstream's engine parser)
    bare = f"<{DSML}tool_calls>\n<{DSML}invoke name=\"f\">\n<{DSML}parameter name=\"n\">7</{DSML}parameter>\n" \
           f"<{DSML}parameter name=\"s\">not json</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>"
    assert json.loads(collect(tools("deepseek_v4"), [bare])[1][0][1]) == {"n": 7, "s": "not json"}


def test_dsml_v32_wrapper_is_not_v4s():
    v4_text = dsml_block("deepseek_v4", dsml_call("get_time", []))
    content, calls = collect(tools("deepseek_v32"), [v4_text])
    assert calls == [] and content == v4_text  # not its markup: content, nothing lost


def test_dsml_text_after_the_block_and_a_literal_end_tag_in_a_value():
    value = f"write </{DSML}parameter> literally"
    text = dsml_block("deepseek_v4", dsml_call("get_weather", [("city", True, value)])) + "\nDone."
    content, calls = collect(tools("deepseek_v4"), [text])
    assert json.loads(calls[0][1]) == {"city": value}
    assert content == "Done."  # whitespace right after the block is layout; upstream drops the text in batch


def test_dsml_cut_off_call_is_closed():
    text = dsml_block("deepseek_v4", dsml_call("get_weather", [("city", True, "Seoul"), ("days", False, "12")]))
    for end in range(len(text)):
        content, calls = collect(tools("deepseek_v4"), [text[:end]])
        for _, args in calls:
            assert isinstance(json.loads(args), dict)


# --- granite4 ---------------------------------------------------------------------------------------------

def test_granite4_keeps_text_around_calls_and_emits_whole_calls():
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> in a string"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>\n'
            "Anything else?")
    content, calls = collect(tools("granite4"), [text])
    assert content == "Sure.\nAnything else?"
    assert calls == [("get_weather", '{"city": "</tool_call> in a string"}'), ("get_time", '{"tz": "UTC"}')]
    assert collect(tools("granite4"), list(text)) == (content, calls)


@pytest.mark.parametrize("block", [
    "<tool_call>{broken</tool_call>",  # malformed JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut off
    "<tool_call>not json",
])
def test_granite4_a_block_that_is_not_a_call_is_content(block):
    text = "Before " + block
    assert collect(tools("granite4"), [text]) == (text, [])
    assert collect(tools("granite4"), list(text)) == (text, [])


# --- Llama 4 ----------------------------------------------------------------------------------------------

def test_llama4_pythonic_drops_the_python_markers():
    text = "<|python_start|>[get_weather(city='Paris', days=3), get_time()]<|python_end|>"
    content, calls = collect(tools("llama4_pythonic"), [text])
    assert content == ""
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]
    assert collect(tools("llama4_pythonic"), list(text)) == (content, calls)
    assert collect(tools("llama4_pythonic"), ["It is sunny."]) == ("It is sunny.", [])


@pytest.mark.parametrize("cut, arguments", [
    ("[get_weather(", "{}"), ("[get_weather(city='Par", '{"city": "Par"}'),
    ("[get_weather(city='Paris', days=3", None), ("[get_weather(city='Paris', days=3,", None),
])
def test_llama4_pythonic_closes_a_cut_off_call(cut, arguments):
    _, calls = collect(tools("llama4_pythonic"), ["<|python_start|>" + cut])
    assert isinstance(json.loads(calls[0][1]), dict)
    if arguments is not None:
        assert calls[0][1] == arguments
    assert collect(tools("llama4_pythonic"), list("<|python_start|>" + cut)) == ("", calls)


def test_llama4_json_is_llama3_json():
    assert get_tool_parser("llama4_json") is get_tool_parser("llama3_json")  # one class upstream too
    content, calls = collect(tools("llama4_json"), ['{"name": "get_time", "parameters": {}}'])
    assert calls == [("get_time", "{}")]


# --- the two invariants, as properties --------------------------------------------------------------------

PROSE = st.lists(st.sampled_from(list("ab ,.\n😀\"\\{}[]<>/=é") + ["Seoul"]), min_size=1, max_size=12).map("".join)
VALUE = st.text(alphabet=st.sampled_from(list("xy \n\"\\<>/{}😀")), max_size=10)


def _render_call(family: str, name: str, value: str, days: int) -> str:
    if family in ("deepseek_v4", "deepseek_v32"):
        return dsml_call(name, [("city", True, value), ("days", False, str(days))])
    if family == "granite4":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"city": value, "days": days}}) + "\n</tool_call>"
    return f"{name}(city={value!r}, days={days})"


def _render_output(family: str, prose: list[str], calls: list[tuple[str, int]]) -> tuple[str, list[str]]:
    """The output text, and the prose segments a correct parser must return as content."""
    if family in ("deepseek_v4", "deepseek_v32"):
        before = prose[0]
        return before + dsml_block(family, "".join(_render_call(family, "get_weather", v, d) for v, d in calls)) \
            + prose[-1], [before, prose[-1].strip()]
    if family == "granite4":
        parts, kept = [], []
        for i, (v, d) in enumerate(calls):
            parts.append(prose[i % len(prose)])
            kept.append(prose[i % len(prose)].strip())
            parts.append(_render_call(family, "get_weather", v, d))
        parts.append(prose[-1])
        kept.append(prose[-1].strip())
        return "".join(parts), kept
    inner = ", ".join(_render_call(family, "get_weather", v, d) for v, d in calls)
    return f"<|python_start|>[{inner}]<|python_end|>", []


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["deepseek_v4", "deepseek_v32", "granite4", "llama4_pythonic"]),
       st.lists(PROSE, min_size=1, max_size=3), st.lists(st.tuples(VALUE, st.integers(-5, 500)), min_size=1,
                                                          max_size=3),
       st.lists(st.integers(0, 400), max_size=10), st.integers(0, 10_000))
def test_property_invariants_for_every_chunking_and_every_cut(family, prose, calls, cuts, cut_at):
    text, kept = _render_output(family, prose, calls)
    parser = tools(family)
    whole = collect(parser, [text])
    points = sorted({c for c in cuts if 0 < c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert collect(tools(family), chunks) == whole
    content, got = whole
    # the complete output: every call, with the values written
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", {"city": v, "days": d}) for v, d in calls]
    for segment in kept:  # nothing lost: the model's prose is content, in order
        assert segment in content
    # cut off anywhere: every call's arguments are still a JSON object
    end = cut_at % (len(text) + 1)
    for _, args in collect(tools(family), [text[:end]])[1]:
        assert isinstance(json.loads(args), dict)
