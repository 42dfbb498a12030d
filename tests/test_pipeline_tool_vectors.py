"""parser-semantics.md §6.2 tool vectors through the whole pipeline (real Qwen3 tokens -> detokenizer ->
reasoning -> tool parser -> deltas): stream fold == batch for random chunkings, values JSON-equal."""

from __future__ import annotations

import json
from functools import lru_cache

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import MessageAccumulator, Pipeline, PipelineConfig, derender_all
from render_service.tokenize.byte_level import BYTE_TO_CHAR
from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR

TOOLS = [
    ToolSpec("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}}}),
    ToolSpec("get_time", {"type": "object", "properties": {}}),
    ToolSpec("write_file", {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}),
    ToolSpec("send", {"type": "object", "properties": {"text": {"type": "string"}}}),
    ToolSpec("run", {"type": "object", "properties": {"code": {"type": "string"}}}),
]
DS_B, DS_CB, DS_SEP, DS_CE, DS_E = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def hermes_call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# name: (tool parser, reasoning parser, text, expected content, expected [(name, arguments)], expected reasoning)
VECTORS = {
    "V-T02": ("hermes", None, "I'll check both cities.\n" + hermes_call("get_weather", '{"city": "Paris"}') + "\n"
              + hermes_call("get_weather", '{"city": "Tokyo"}'),
              "I'll check both cities.\n", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})], None),
    "V-T05": ("hermes", None, hermes_call("run", json.dumps({"code": "if (x) { return '}'; }"})), None,
              [("run", {"code": "if (x) { return '}'; }"})], None),
    "V-T06": ("hermes", None, hermes_call("write_file", '{"path": "a.md", "content": "Use </tool_call> to close."}'),
              None, [("write_file", {"path": "a.md", "content": "Use </tool_call> to close."})], None),
    "V-T08": ("hermes", None, hermes_call("send", '{"text": "東京 😀"}'), None, [("send", {"text": "東京 😀"})], None),
    "V-T12": ("hermes", "qwen3", "<think>\nNeed the weather tool.\n</think>\n\n" + hermes_call("get_weather", '{"city": "Paris"}'),
              "\n\n", [("get_weather", {"city": "Paris"})], "\nNeed the weather tool.\n"),
    "V-T15": ("qwen3_coder", None, "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>",
              None, [("get_weather", {"city": "New York", "days": 3, "metric": True})], None),
    "V-T18": ("qwen3_coder", None, "Checking.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
              "Checking.\n", [("get_time", {})], None),
    "qwen3_coder_inside_think": ("qwen3_coder", "qwen3", "plan<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                                 None, [("get_time", {})], "plan"),
    "V-T20": ("hermes", "qwen3", "Maybe use <tool_call> syntax later.</think>Done", "Done", [],
              "Maybe use <tool_call> syntax later."),
    "V-T21": ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "San Francisco"}}', None,
              [("get_weather", {"city": "San Francisco"})], None),
    "V-T26": ("mistral", None, '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})], None),
    "V-T27": ("mistral", None, 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]', "Sure. ", [("get_weather", {"city": "Paris"}), ("get_time", {})], None),
    "V-T29": ("deepseek_v31", None, f'Let me check.{DS_B}{DS_CB}get_weather{DS_SEP}{{"city": "Tokyo"}}{DS_CE}{DS_E}',
              "Let me check.", [("get_weather", {"city": "Tokyo"})], None),
    "V-T30": ("deepseek_v31", None, f'{DS_B}{DS_CB}get_weather{DS_SEP}{{\n  "city": "Tokyo"\n}}{DS_CE}{DS_E}',
              None, [("get_weather", {"city": "Tokyo"})], None),
    "kimi_k2": ("kimi_k2", None, '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>',
                None, [("get_weather", {"city": "Beijing"})], None),
    "pythonic": ("pythonic", None, "[get_weather(city='San Francisco', metric=True), get_time()]", None,
                 [("get_weather", {"city": "San Francisco", "metric": True}), ("get_time", {})], None),
}


@lru_cache(maxsize=1)
def qwen():
    return load_bundle(str(SHARED / "fixtures/qwen3-0.6b")).tokenizer


def pipeline_for(name: str) -> Pipeline:
    tool, reasoning, *_ = VECTORS[name]
    return Pipeline(qwen(), PipelineConfig(request_id="req-v", reasoning_parser=reasoning, tool_parser=tool,
                                           tool_choice="auto", tools=TOOLS))


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_vector_values_through_the_pipeline(name):
    _, _, text, content, calls, reasoning = VECTORS[name]
    pipeline = pipeline_for(name)
    msg, state = derender_all(pipeline, qwen().encode(text))
    assert msg["content"] == content
    assert msg["reasoning"] == reasoning
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert got == calls
    assert len({c["id"] for c in msg["tool_calls"]}) == len(calls)
    assert pipeline.finish_reason(state, "stop") == ("tool_calls" if calls else "stop")
    if name == "kimi_k2":
        assert msg["tool_calls"][0]["id"] == "functions.get_weather:0"  # the model's own id


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_vector_stream_fold_equals_batch(name):
    text = VECTORS[name][2]
    pipeline = pipeline_for(name)
    tok = qwen()
    batch, _ = derender_all(pipeline, tok.encode(text))
    byte_table = BYTE_TO_CHAR

    @settings(max_examples=15, deadline=None)
    @given(st.data())
    def check(data):
        # some pieces byte by byte (markers and multi-byte characters split across tokens)
        ids, i = [], 0
        while i < len(text):
            j = data.draw(st.integers(i + 1, min(len(text), i + 10)))
            piece = text[i:j]
            ids += ([tok.token_to_id(byte_table[b]) for b in piece.encode()] if data.draw(st.booleans())
                    else tok.encode(piece))
            i = j
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1)), max_size=30)))
        state = pipeline.initial_state()
        acc = MessageAccumulator()
        start = 0
        for c in [*cuts, len(ids)]:
            state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
            acc.add(pipeline.feed(state, ids[start:c]))
            start = c
        acc.add(pipeline.finish(state))
        assert acc.message() == batch

    check()
