"""Gemma 4's and FunctionGemma's ``call:NAME{...}`` tool calls (``tools_gemma``), over Gemma 4's own template and a
test tokenizer with Gemma 4's control tokens at their ids (``tests/family_bundles.py``)."""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import detect_family, resolve_auto
from render_service.parsers.base import ToolCallPiece, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.registry import get_tool_parser
from render_service.render.render import render_chat_prompt
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import TEMPLATES, write_family_bundle
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import WEATHER_TOOLS, parse, parse_chunks

pytestmark = pytest.mark.slow  # builds a test tokenizer (cached after the first run)

Q = '<|"|>'
TOOLS = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}), ToolSpec(name="get_time")]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return load_bundle(write_family_bundle("gemma4", tmp_path_factory.mktemp("gemma4") / "bundle"))


@pytest.mark.parametrize("text, calls, content", [
    (f"Sure.<|tool_call>call:get_weather{{city:{Q}Paris, {{FR}}{Q},days:3}}<tool_call|>",
     [("get_weather", {"city": "Paris, {FR}", "days": 3})], "Sure."),
    (f"<|tool_call>call:f{{n:-1.5,b:false,o:{{k:{Q}v{Q},l:[1,{Q}a{Q},true]}},s:None}}<tool_call|>after",
     [("f", {"n": -1.5, "b": False, "o": {"k": "v", "l": [1, "a", True]}, "s": "None"})], "after"),
    ("<|tool_call>call:get_time{}<tool_call|><|tool_call>call:get_time{}<tool_call|>",
     [("get_time", {}), ("get_time", {})], None),
    # a key running into a brace breaks the call off: closed, the rest is content
    ("<|tool_call>call:f{a:1,b}c}<tool_call|>", [("f", {"a": 1})], "b}c}"),
    # not call:NAME{ : the block is content
    ("<|tool_call>get_weather{}<tool_call|>", [], "get_weather{}"),
])
def test_gemma4_calls(text, calls, content) -> None:
    folded = parse("gemma4", text)
    assert parse_chunks("gemma4", list(text)) == folded
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == calls
    assert folded.content == content


def test_gemma4_streams_a_string_value_as_it_arrives() -> None:
    parser = get_tool_parser("gemma4")(WEATHER_TOOLS)
    state = parser.initial_state()
    pieces = parser.feed(state, f"<|tool_call>call:get_weather{{city:{Q}Sa")
    assert pieces == [ToolCallPiece(index=0, name="get_weather", arguments='{"city": "Sa')]


def test_functiongemma_reads_delimited_values_as_json_when_they_parse() -> None:
    text = ("<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:<escape>3<escape>,"
            "tags:<escape>[\"a\"]<escape>,x:<escape>NaN<escape>}<end_function_call>")
    folded = parse("functiongemma", text)
    assert parse_chunks("functiongemma", list(text)) == folded
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "tags": ["a"], "x": "NaN"})]


def test_gemma4_control_tokens_are_single_ids(gemma4) -> None:
    tok = gemma4.tokenizer
    for text, i in (("<|tool_call>", 48), ("<tool_call|>", 49), (Q, 52), ("<|channel>", 100), ("<turn|>", 106)):
        assert tok.encode(text) == [i]


def test_gemma4_template_renders_calls_the_parser_reads_back(gemma4) -> None:
    # the template writes an earlier call in the model's format: that text, parsed, is the call again
    config = build_render_config(gemma4, served_model_names=["m"], reasoning_parser="gemma4", tool_call_parser="gemma4")
    args = {"city": "Seoul", "days": 3}
    req = msgspec.convert({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
        ChatCompletionRequest)
    ids, _ = render_chat_prompt(req, config)
    text = gemma4.tokenizer.decode(ids, skip_special_tokens=False)
    start = text.index("<|tool_call>")
    written = text[start:text.index("<tool_call|>") + len("<tool_call|>")]
    assert [(c["name"], json.loads(c["arguments"])) for c in parse("gemma4", written).calls] == [
        ("get_weather", args)]


def test_gemma4_one_token_streaming_equals_batch(gemma4) -> None:
    tok = gemma4.tokenizer
    text = (f"<|channel>thought\nNeed Seoul's weather 😀.<channel|>Checking.<|tool_call>call:get_weather{{city:{Q}"
            f"Seoul 🌧{Q},days:3}}<tool_call|><|tool_call>call:get_time{{}}<tool_call|>")
    ids = tok.encode(text)
    assert 48 in ids and 52 in ids
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="gemma4", tool_parser="gemma4",
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("get_weather", {"city": "Seoul 🌧", "days": 3}), ("get_time", {})]
    assert batch["reasoning"] == "Need Seoul's weather 😀." and batch["content"] == "Checking."


def test_auto_picks_gemma4_for_both_flags() -> None:
    source = (TEMPLATES / "gemma-4.jinja").read_text(encoding="utf-8")
    assert detect_family(source, None).name == "gemma-4"
    assert resolve_auto("auto", "auto", source, "gemma4") == ("gemma4", "gemma4")
