"""Ricursive Ripple's parsers (``ripple``): a ``<think>`` block the model opens per turn and Hermes' JSON calls,
every marker framed by newlines that belong to it, spelled in plain text (upstream's parser docstring gives the
shape; no Ripple template or tokenizer is in the sources we can read, so the pipeline runs on Qwen3's, where the
markers are single ids, and the parser alone on characters, where they are spelled)."""

from __future__ import annotations

import json

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ReasoningParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.registry import get_reasoning_parser
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import parse, parse_chunks, split_reasoning

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _split(text: str, kwargs: dict | None = None) -> list[tuple[str, str]]:
    cls = get_reasoning_parser("ripple")
    parser = cls(ReasoningParserConfig(enable_thinking=cls.enable_thinking_from(kwargs)))

    return split_reasoning(parser, text)


@pytest.mark.parametrize("text, expected", [
    # the template's framing: <think>\n ... \n</think>\n
    ("<think>\nThe user wants Paris.\n</think>\nIt is sunny.",
     [("reasoning", "The user wants Paris."), ("content", "It is sunny.")]),
    # the model decides per turn: no block is all content
    ("It is sunny.", [("content", "It is sunny.")]),
    ("<think>plan</think>answer", [("reasoning", "plan"), ("content", "answer")]),
    # only one newline on each side is the marker's
    ("<think>\n\na\nb\n\n</think>\n\nx", [("reasoning", "\na\nb\n"), ("content", "\nx")]),
    ("<think>\n</think>\nanswer", [("content", "answer")]),
    # a call ends an unclosed block; the newline before it is the call marker's
    (f"<think>\nplan\n{CALL}", [("reasoning", "plan"), ("content", CALL)]),
    # cut off inside the block: all of it is reasoning
    ("<think>\nplan\n", [("reasoning", "plan\n")]),
    # a block later in the reply is the answer's text (upstream's engine opens reasoning there too)
    ("x <think>y</think>", [("content", "x <think>y</think>")]),
])
def test_ripple_reasoning(text, expected) -> None:
    assert _split(text) == expected
    assert _split(text, {"enable_thinking": False}) == expected  # no switch: upstream drops the kwargs


@pytest.mark.parametrize("text, calls, content", [
    # the newline before a call is the call marker's; the one after its end marker is content (upstream's terminals)
    ("Let me check.\n" + CALL + "\nDone.", [("get_weather", {"city": "Paris"})], "Let me check.\nDone."),
    ("Line one.\nLine two.\n", [], "Line one.\nLine two.\n"),
    ("Not a call:\n<tool_call>x</tool_call>", [], "Not a call:\n<tool_call>x</tool_call>"),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
     None),
    # a call without arguments gets {} (upstream's converter)
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', [("get_time", {})], None),
    ("No call: <tool_call is not a tag>", [], "No call: <tool_call is not a tag>"),
])
def test_ripple_calls(text, calls, content) -> None:
    folded = parse("ripple", text)
    assert parse_chunks("ripple", list(text)) == folded
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == calls
    assert folded.content == content


def test_ripple_one_token_streaming_equals_batch() -> None:
    tok = load_bundle(str(QWEN3_FIXTURE_DIR)).tokenizer
    text = ("<think>\nNeed Seoul's weather 😀.\n</think>\nChecking.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Seoul 🌧", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    ids = tok.encode(text)
    tools = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}), ToolSpec(name="get_time")]
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="ripple", tool_parser="ripple",
                                            tool_choice="auto", tools=tools, skip_special_tokens=False))
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("get_weather", {"city": "Seoul 🌧", "days": 3}), ("get_time", {})]
    assert batch["reasoning"] == "Need Seoul's weather 😀." and batch["content"] == "Checking."
