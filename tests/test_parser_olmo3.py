"""OLMo 3's pythonic calls in ``<function_calls>`` (``olmo3``), over vLLM's OLMo 3 tool template and Qwen3's real
tokenizer (the same ChatML tokens; OLMo 3's tags are spelled with ordinary tokens in both)."""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import resolve_auto
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.render.render import render_chat_prompt
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import TEMPLATES
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import parse, parse_chunks

TEMPLATE = (TEMPLATES / "olmo3-tool.jinja").read_text(encoding="utf-8")
TOOLS = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}), ToolSpec(name="get_time")]


@pytest.fixture(scope="module")
def qwen3():
    return load_bundle(str(QWEN3_FIXTURE_DIR))


@pytest.mark.parametrize("text, calls, content", [
    ("Checking.\n<function_calls>\nget_weather(city='Paris', days=3)\nget_time()\n</function_calls>",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})], "Checking.\n"),
    ("<function_calls>f(a=null, b=true, c={'k': [false, None]})</function_calls>",
     [("f", {"a": None, "b": True, "c": {"k": [False, None]}})], None),
    # no tags: text (upstream's batch path also reads bare lines as calls; its streaming path does not)
    ("get_time()", [], "get_time()"),
    # a positional argument breaks the call off: closed, the rest of the block is content
    ("<function_calls>f(1)</function_calls>", [("f", {})], "1)"),
])
def test_olmo3_calls(text, calls, content) -> None:
    folded = parse("olmo3", text)
    assert parse_chunks("olmo3", list(text)) == folded
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == calls
    assert folded.content == content


def test_template_text_given_inline_renders_calls_the_parser_reads_back(qwen3) -> None:
    # the template as --chat-template text (not a path): its long lines are not taken for a file name
    config = build_render_config(qwen3, served_model_names=["m"], chat_template=TEMPLATE, tool_call_parser="olmo3")
    args = {"city": "Seoul", "days": 3, "metric": True, "note": None}
    req = msgspec.convert({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
        ChatCompletionRequest)
    ids, _ = render_chat_prompt(req, config)
    text = qwen3.tokenizer.decode(ids, skip_special_tokens=False)
    start = text.index("<|im_start|>assistant\n<function_calls>") + len("<|im_start|>assistant\n")
    written = text[start:text.index("</function_calls>", start) + len("</function_calls>")]
    assert [(c["name"], json.loads(c["arguments"])) for c in parse("olmo3", written).calls] == [
        ("get_weather", args)]


def test_olmo3_one_token_streaming_equals_batch(qwen3) -> None:
    tok = qwen3.tokenizer
    ids = tok.encode("<think>Seoul 😀?</think>Checking.\n<function_calls>\nget_weather(city='Seoul 🌧', days=3)\n"
                     "get_time()\n</function_calls>")
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="olmo3", tool_parser="olmo3",
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("get_weather", {"city": "Seoul 🌧", "days": 3}), ("get_time", {})]
    assert batch["reasoning"] == "Seoul 😀?" and batch["content"] == "Checking.\n"


def test_auto_picks_olmo3_tools_from_the_template() -> None:
    assert resolve_auto("auto", "auto", TEMPLATE, None) == (None, "olmo3")  # no <think>: the instruct model
    assert resolve_auto("auto", "auto", None, "olmo3") == ("olmo3", "olmo3")
