"""ZAYA1's parsers (``zaya`` and its alias ``zaya_xml``): Qwen3's XML calls and ``<think>`` reasoning with the call
block spelled ``<zyphra_tool_call>``, over a test tokenizer with ZAYA1's tags as single ids
(``tests/family_bundles.py``). The call vectors are vLLM's Qwen3 engine tests (the engine ZAYA1's parser reuses)
with ZAYA1's block tags."""

from __future__ import annotations

import json

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import resolve_auto
from render_service.parsers.base import ReasoningParserConfig, ToolParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.registry import get_reasoning_parser
from tests.family_bundles import template_text, write_family_bundle
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import parse, parse_chunks, split_reasoning

pytestmark = pytest.mark.slow  # builds a test tokenizer (cached after the first run)

NO_SCHEMA = ToolParserConfig()  # upstream's vectors run without tools: every value is a string
OPEN, CLOSE = "<zyphra_tool_call>", "</zyphra_tool_call>"


@pytest.fixture(scope="module")
def zaya(tmp_path_factory):
    return load_bundle(write_family_bundle("zaya", tmp_path_factory.mktemp("zaya") / "bundle"))


@pytest.mark.parametrize("text, calls, content", [
    (f"{OPEN}\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n</function>\n{CLOSE}",
     [("get_weather", {"city": "Tokyo"})], None),
    # the model's multi-line values lose the newline on each side (the template's layout)
    (f"{OPEN}\n<function=Bash>\n<parameter=command>\nls -la /tmp\n</parameter>\n<parameter=description>\n"
     f"List files in /tmp directory\n</parameter>\n</function>\n{CLOSE}",
     [("Bash", {"command": "ls -la /tmp", "description": "List files in /tmp directory"})], None),
    (f"{OPEN}\n<function=search>\n<parameter=query>vllm parsing</parameter>\n<parameter=limit>10</parameter>\n"
     f"<parameter=exact_match>false</parameter>\n</function>\n{CLOSE}",
     [("search", {"query": "vllm parsing", "limit": "10", "exact_match": "false"})], None),
    (f"{OPEN}\n<function=refresh>\n</function>\n{CLOSE}", [("refresh", {})], None),
    # a second call opened before the first block closed
    (f"{OPEN}\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n</function>\n{OPEN}\n"
     f"<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n{CLOSE}",
     [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris"})], None),
    (f'{OPEN}\n<function=test_function>\n<parameter=quoted>He said "hello"</parameter>\n'
     f"<parameter=path>C:\\Users\\file.txt</parameter>\n</function>\n{CLOSE}",
     [("test_function", {"quoted": 'He said "hello"', "path": "C:\\Users\\file.txt"})], None),
    (f"Let me check the weather for you.\n\n{OPEN}\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n"
     f"</function>\n{CLOSE}\n\nI will get that information.",
     [("get_weather", {"city": "Tokyo"})], "Let me check the weather for you.\n\nI will get that information."),
])
@pytest.mark.parametrize("name", ["zaya", "zaya_xml"])
def test_zaya_calls(name, text, calls, content) -> None:
    folded = parse(name, text, NO_SCHEMA)
    assert parse_chunks(name, list(text), NO_SCHEMA) == folded
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == calls
    assert folded.content == content


def test_qwen3s_own_block_is_text_to_zaya_but_a_bare_function_is_a_call() -> None:
    assert parse("zaya", "a <tool_call>b</tool_call>").content == "a <tool_call>b</tool_call>"
    # upstream's grammar also starts a call at <function= outside the block
    folded = parse("zaya", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert folded.calls[0]["name"] == "get_time" and folded.content == "<tool_call>\n</tool_call>"


def _split(text: str, kwargs: dict | None = None) -> list[tuple[str, str]]:
    cls = get_reasoning_parser("zaya")
    parser = cls(ReasoningParserConfig(enable_thinking=cls.enable_thinking_from(kwargs)))

    return split_reasoning(parser, text)


@pytest.mark.parametrize("text, kwargs, expected", [
    ("<think>\nplan\n</think>\n\nanswer", None, [("reasoning", "\nplan\n"), ("content", "\n\nanswer")]),
    ("plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("answer", {"enable_thinking": False}, [("content", "answer")]),
    # a call opened inside an unclosed think block ends the reasoning; the block is the tool parser's
    (f"plan\n{OPEN}\n<function=f>\n</function>\n{CLOSE}", None,
     [("reasoning", "plan\n"), ("content", f"{OPEN}\n<function=f>\n</function>\n{CLOSE}")]),
    # Qwen3's own tag is ZAYA1's reasoning text; so is ZAYA1's tag with no call after it
    ("use <tool_call>\n<function=f> here</think>x", None,
     [("reasoning", "use <tool_call>\n<function=f> here"), ("content", "x")]),
    (f"the {OPEN} tag</think>x", None, [("reasoning", f"the {OPEN} tag"), ("content", "x")]),
])
def test_zaya_reasoning(text, kwargs, expected) -> None:
    assert _split(text, kwargs) == expected


def test_zaya_tags_are_single_ids(zaya) -> None:
    tok = zaya.tokenizer
    for text, i in ((OPEN, 101), (CLOSE, 102), ("<zyphra_tool_response>", 103), ("<think>", 105), ("</think>", 106)):
        assert tok.encode(text) == [i]


def test_zaya_one_token_streaming_equals_batch(zaya) -> None:
    tok = zaya.tokenizer
    text = (f"<think>\nNeed Seoul's weather 😀.\n</think>\n\nChecking.\n{OPEN}\n<function=get_weather>\n"
            f"<parameter=city>\nSeoul 🌧\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n{CLOSE}\n"
            f"{OPEN}\n<function=get_time>\n</function>\n{CLOSE}")
    ids = tok.encode(text)
    assert ids.count(101) == 2 and 105 in ids
    tools = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}), ToolSpec(name="get_time")]
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="zaya", tool_parser="zaya",
                                            tool_choice="auto", tools=tools, skip_special_tokens=False))
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("get_weather", {"city": "Seoul 🌧", "days": 3}), ("get_time", {})]
    assert batch["reasoning"] == "\nNeed Seoul's weather 😀.\n" and batch["content"] == "\n\nChecking.\n"


def test_auto_picks_zaya_for_both_flags() -> None:
    assert resolve_auto("auto", "auto", template_text("zaya1-standin.jinja"), None) == ("zaya", "zaya")
    assert resolve_auto("auto", "auto", None, "zaya") == ("zaya", "zaya")
