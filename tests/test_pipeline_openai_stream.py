"""The gateway's OpenAI chunk stream from engine events (``gateway.responses.ChatResponder``, what the gateway
answers with): role first, deltas, finish, usage, n>1, the reasoning field switch, stream equals batch."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any

import msgspec

from render_service.gateway.responses import ChatResponder
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.render.render import render_chat
from render_service.render.render_config import RenderConfig, load_render_config
from render_service.wire.protocol import ChatCompletionRequest, GenerateStreamChoice
from tests.shared_paths import QWEN3_FIXTURE_DIR

EOS = 151645
THINK, END_THINK = 151667, 151668
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@lru_cache(maxsize=1)
def parser_config() -> RenderConfig:
    return load_render_config(str(QWEN3_FIXTURE_DIR), served_model_names=["m"], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)


@lru_cache(maxsize=1)
def plain_config() -> RenderConfig:
    return load_render_config(str(QWEN3_FIXTURE_DIR), served_model_names=["m"])


def responder(cfg: RenderConfig | None = None, **request: Any) -> ChatResponder:
    cfg = cfg or parser_config()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "weather?"}], "stream": True, **request}
    if cfg.tool_call_parser:
        body.setdefault("tools", TOOLS)
    req = msgspec.convert(body, ChatCompletionRequest)
    return ChatResponder(render_chat(req, cfg, request_id="1"), req, cfg)


def step(r: ChatResponder, index: int, ids: list[int], finish_reason: str | None = None) -> list[dict[str, Any]]:
    """One engine event of choice ``index`` through the gateway's SSE path, as decoded chunks."""
    raw = r.stream_batch([(0, GenerateStreamChoice(index=index, token_ids=ids, finish_reason=finish_reason))])
    return [json.loads(event.removeprefix(b"data: ")) for event in raw.split(b"\n\n") if event]


def delta(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk's delta without its null keys (the wire carries them; the test is about the values)."""
    return {k: v for k, v in chunk["choices"][0]["delta"].items() if v is not None}


def test_v_s01_plain_stream_shape_with_usage():
    r = responder(plain_config(), stream_options={"include_usage": True})
    tok = plain_config().tokenizer
    chunks = step(r, 0, tok.encode("Hi")) + step(r, 0, [EOS], finish_reason="stop")
    usage = msgspec.to_builtins(r.usage_chunk())
    assert delta(chunks[0]) == {"role": "assistant", "content": ""}
    assert delta(chunks[1]) == {"content": "Hi"}
    assert delta(chunks[2]) == {} and chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["choices"][0]["stop_reason"] is None
    completion = len(tok.encode("Hi")) + 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == completion
    assert usage["usage"]["total_tokens"] == r.prompt_tokens + completion
    assert all(c.get("usage") is None for c in chunks)


def test_v_s02_tags_alone_send_no_chunk_and_reasoning_precedes_content():
    r = responder()
    tok = parser_config().tokenizer
    chunks = []
    for t in [THINK, *tok.encode("Need"), END_THINK, *tok.encode("4")]:
        chunks += step(r, 0, [t])
    chunks += step(r, 0, [EOS], finish_reason="stop")
    deltas = [delta(c) for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:] == [{"reasoning": "Need"}, {"content": "4"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_v_s04_continuous_usage_counts_cumulative_tokens():
    r = responder(stream_options={"include_usage": True, "continuous_usage_stats": True})
    tok = parser_config().tokenizer
    ab = tok.encode("ab")
    chunks = step(r, 0, [THINK]) + step(r, 0, ab) + step(r, 0, [EOS], finish_reason="stop")
    assert delta(chunks[0])["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
    assert [c["usage"]["completion_tokens"] for c in chunks[1:]] == [1 + len(ab), 2 + len(ab)]


def test_reasoning_field_switch():
    tok = parser_config().tokenizer
    for field, keys in (("reasoning", {"reasoning"}), ("reasoning_content", {"reasoning_content"}),
                        ("both", {"reasoning", "reasoning_content"})):
        r = responder(dataclasses.replace(parser_config(), reasoning_field=field))
        chunks = step(r, 0, [THINK]) + step(r, 0, tok.encode("x"))
        assert set(delta(chunks[-1])) == keys


def test_tool_call_stream_equals_batch_and_finishes_with_tool_calls():
    tok = parser_config().tokenizer
    text = '<think>r</think>ok<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text) + [EOS]
    r = responder()
    chunks = []
    for i, t in enumerate(ids):
        chunks += step(r, 0, [t], finish_reason="stop" if i == len(ids) - 1 else None)
    calls = [tc for c in chunks for tc in delta(c).get("tool_calls", [])]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"].get("arguments") or "" for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    batch, _ = derender_all(Pipeline(tok, PipelineConfig(
        request_id=r.response_id, reasoning_parser="qwen3", tool_parser="hermes", tool_choice="auto",
        tools=[ToolSpec("get_weather")], hidden_token_ids=frozenset({EOS}), skip_special_tokens=False)), ids)
    assert batch["tool_calls"][0]["id"] == calls[0]["id"]


def test_length_stays_length_even_after_a_tool_call():
    tok = parser_config().tokenizer
    ids = tok.encode('<think>r</think><tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nAlso')
    r = responder()
    chunks = step(r, 0, ids[:-1]) + step(r, 0, ids[-1:], finish_reason="length")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n2_choices_each_get_role_and_finish_with_their_index():
    tok = parser_config().tokenizer
    r = responder(n=2)
    chunks = []
    for t in tok.encode("<think>a</think>b"):
        chunks += step(r, 0, [t]) + step(r, 1, [t])
    chunks += step(r, 1, [EOS], finish_reason="stop") + step(r, 0, [EOS], finish_reason="stop")
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert sum(1 for m in mine if m["delta"].get("role")) == 1
        assert mine[-1]["finish_reason"] == "stop"
        assert "".join(m["delta"].get("content") or "" for m in mine[1:]) == "b"


def test_forced_tool_choice_answers_empty_content_as_batch_derender_does():
    # Named tool choice (a JSON grammar after the reasoning): the gateway's non-streaming answer and batch
    # derender read the same rule (tool_choice.forces_a_call): content "" beside the call, never null (vLLM).
    from render_service.derender.batch import derender_chat
    from render_service.wire.protocol import DerenderChatRequest

    cfg, tok = parser_config(), parser_config().tokenizer
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = responder(cfg, stream=False, tool_choice=named)
    ids = tok.encode('<think>r</think>{"city": "Paris"}') + [EOS]
    r.accumulate(0, GenerateStreamChoice(index=0, token_ids=ids, finish_reason="stop"))
    gateway = msgspec.to_builtins(r.response())["choices"][0]["message"]
    assert gateway["content"] == "" and gateway["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    batch = derender_chat(msgspec.convert({
        "generate_response": {"request_id": r.gens[0].request_id, "choices": [
            {"index": 0, "token_ids": ids, "finish_reason": "stop"}]},
        "chat_request": {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "tool_choice": named},
    }, DerenderChatRequest), cfg)
    assert msgspec.to_builtins(batch)["choices"][0]["message"] == gateway
