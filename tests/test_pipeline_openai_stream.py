"""OpenAI chunk stream from engine steps: role first, deltas, finish, usage, n>1, reasoning field switch."""

from __future__ import annotations

from tests.shared_paths import SHARED as SHARED_DIR
import json
from functools import lru_cache
from pathlib import Path

from render_service.bundle import load_bundle
from render_service.parsers.base import ToolSpec
from render_service.parsers.openai_stream import ChatStreamAssembler
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all

SHARED = SHARED_DIR

EOS = 151645


@lru_cache(maxsize=1)
def qwen():
    return load_bundle(str(SHARED / "fixtures/qwen3-0.6b")).tokenizer


def assembler(**kw) -> ChatStreamAssembler:
    cfg = dict(reasoning_parser="qwen3", tool_parser="hermes", tool_choice="auto", tools=[ToolSpec("get_weather")],
               hidden_token_ids=frozenset({EOS}), skip_special_tokens=False)
    return ChatStreamAssembler(qwen(), lambda i: PipelineConfig(request_id="chatcmpl-1", choice_index=i, **cfg),
                               response_id="chatcmpl-1", model="m", created=1, prompt_tokens=10, **kw)


def test_v_s01_plain_stream_shape_with_usage():
    tok = qwen()
    a = ChatStreamAssembler(tok, lambda i: PipelineConfig(hidden_token_ids=frozenset({EOS})), response_id="x",
                            model="m", created=1, prompt_tokens=10, include_usage=True)
    chunks = a.step(0, tok.encode("Hi")) + a.step(0, [EOS], finish_reason="stop")
    chunks.append(a.usage_chunk())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert chunks[2]["choices"][0]["delta"] == {} and chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["choices"][0]["stop_reason"] is None
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {"prompt_tokens": 10, "total_tokens": 12,
                                                                 "completion_tokens": 2}
    assert all("usage" not in c for c in chunks[:3])


def test_v_s02_tags_alone_send_no_chunk_and_reasoning_precedes_content():
    tok = qwen()
    a = assembler()
    chunks = []
    for t in [151667, *tok.encode("Need"), 151668, *tok.encode("4")]:
        chunks += a.step(0, [t])
    chunks += a.step(0, [EOS], finish_reason="stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:] == [{"reasoning": "Need"}, {"content": "4"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_v_s04_continuous_usage_counts_cumulative_tokens():
    tok = qwen()
    a = assembler(include_usage=True, continuous_usage_stats=True)
    chunks = a.step(0, [151667]) + a.step(0, tok.encode("ab")) + a.step(0, [EOS], finish_reason="stop")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    assert [c["usage"]["completion_tokens"] for c in chunks[1:]] == [1 + len(tok.encode("ab")), 2 + len(tok.encode("ab"))]


def test_reasoning_field_switch():
    tok = qwen()
    for field, keys in (("reasoning", {"reasoning"}), ("reasoning_content", {"reasoning_content"}),
                        ("both", {"reasoning", "reasoning_content"})):
        a = assembler(reasoning_field=field)
        chunks = a.step(0, tok.encode("x"))
        assert set(chunks[-1]["choices"][0]["delta"]) == keys


def test_tool_call_stream_equals_batch_and_finishes_with_tool_calls():
    tok = qwen()
    text = '<think>r</think>ok<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text) + [EOS]
    a = assembler()
    chunks = []
    for i, t in enumerate(ids):
        chunks += a.step(0, [t], finish_reason="stop" if i == len(ids) - 1 else None)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"].get("arguments", "") for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    batch, _ = derender_all(Pipeline(tok, PipelineConfig(
        request_id="chatcmpl-1", reasoning_parser="qwen3", tool_parser="hermes", tool_choice="auto",
        tools=[ToolSpec("get_weather")], hidden_token_ids=frozenset({EOS}), skip_special_tokens=False)), ids)
    assert batch["tool_calls"][0]["id"] == calls[0]["id"]


def test_length_stays_length_even_after_a_tool_call():
    tok = qwen()
    ids = tok.encode('<think>r</think><tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nAlso')
    a = assembler()
    chunks = a.step(0, ids[:-1]) + a.step(0, ids[-1:], finish_reason="length")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n2_choices_each_get_role_and_finish_with_their_index():
    tok = qwen()
    a = assembler()
    chunks = []
    for t in tok.encode("<think>a</think>b"):
        chunks += a.step(0, [t]) + a.step(1, [t])
    chunks += a.step(1, [EOS], finish_reason="stop") + a.step(0, [EOS], finish_reason="stop")
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert sum(1 for m in mine if m["delta"].get("role")) == 1
        assert mine[-1]["finish_reason"] == "stop"
        assert "".join(m["delta"].get("content", "") for m in mine[1:]) == "b"
