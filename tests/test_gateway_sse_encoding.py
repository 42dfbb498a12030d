"""The gateway's pre-framed SSE chunks: the bytes of its per-token fast path (a pre-encoded envelope
around the delta) equal the full chunk structs encoded one by one, for every delta shape."""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache
from pathlib import Path

import msgspec
import pytest
from tokenizers import Tokenizer

from render_service.gateway.responses import ChatResponder, coalesce, sse
from render_service.render.render import render_chat
from render_service.render.render_config import load_render_config
from render_service.wire.protocol import (
    ChatCompletionRequest,
    GenerateLogprobs,
    GenerateStreamChoice,
    GenerateTokenLogprob,
)
from tests.shared_paths import QWEN3_FIXTURE_DIR

QWEN = QWEN3_FIXTURE_DIR
if not QWEN.exists():
    QWEN = Path(__file__).resolve().parents[2] / "shared/fixtures/qwen3-0.6b"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
OUTPUT = ('<think>\nThe user wants "weather" — in Paris.\n</think>\n\nLet me check \u00e9t\u00e9 \U0001F600.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@lru_cache(maxsize=1)
def base_config():
    return load_render_config(str(QWEN), served_model_names=["qwen3"], reasoning_parser="qwen3",
                              tool_call_parser="hermes", enable_auto_tool_choice=True)


def config(reasoning_field: str):
    # Only the response key changes between these (loading the bundle again would cost seconds).
    return dataclasses.replace(base_config(), reasoning_field=reasoning_field)


@lru_cache(maxsize=1)
def output_ids() -> list[int]:
    return Tokenizer.from_file(str(QWEN / "tokenizer.json")).encode(OUTPUT, add_special_tokens=False).ids


def events(ids: list[int], rnd: random.Random, finish: str) -> list[GenerateStreamChoice]:
    out, i = [], 0
    while i < len(ids):
        step = rnd.choice([1, 1, 1, 2, 3])
        out.append(GenerateStreamChoice(index=0, token_ids=ids[i:i + step]))
        i += step
    out[-1].finish_reason = finish
    return out


def responders(reasoning_field: str, **request) -> tuple[ChatResponder, ChatResponder]:
    cfg = config(reasoning_field)
    req = msgspec.convert({"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": True,
                           **request}, ChatCompletionRequest)
    gen = render_chat(req, cfg, request_id="chatcmpl-fixed")
    fast, reference = ChatResponder(gen, req, cfg), ChatResponder(gen, req, cfg)
    reference.created = fast.created
    return fast, reference


@pytest.mark.parametrize("reasoning_field", ["reasoning", "reasoning_content", "both"])
@pytest.mark.parametrize("seed", range(3))
def test_fast_path_bytes_equal_encoded_chunk_structs(reasoning_field, seed):
    fast, reference = responders(reasoning_field)
    sent, expected = [], []
    for choice in events(output_ids(), random.Random(seed), "stop"):
        sent.append(fast.stream_events(0, msgspec.structs.replace(choice)))
        expected.append(b"".join(sse(c) for c in reference.stream_chunks(0, msgspec.structs.replace(choice))))
    assert sent == expected
    assert fast._envelopes, "the per-token fast path never ran"
    kinds = set()
    for data in b"".join(sent).split(b"\n\n")[:-1]:
        delta = msgspec.json.decode(data.removeprefix(b"data: "))["choices"][0]["delta"]
        kinds.update(k for k, v in delta.items() if v not in (None, ""))
    assert {"role", "content", "tool_calls"} <= kinds and kinds & {"reasoning", "reasoning_content"}


@pytest.mark.parametrize("request_fields", [
    {"stop": ["Paris"]}, {"return_token_ids": True}, {"logprobs": True},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
])
def test_slow_path_cases_keep_their_bytes(request_fields):
    fast, reference = responders("reasoning", **request_fields)
    for choice in events(output_ids(), random.Random(7), "length"):
        a = fast.stream_events(0, msgspec.structs.replace(choice))
        b = b"".join(sse(c) for c in reference.stream_chunks(0, msgspec.structs.replace(choice)))
        assert a == b


# ------------------------------------------------------------------------------- coalescing


def fold(sse_bytes: bytes) -> dict:
    """The message a client assembles from the chunks: text per channel, tool calls by index, finish."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "chunks": 0}
    for data in sse_bytes.split(b"\n\n")[:-1]:
        choice = msgspec.json.decode(data.removeprefix(b"data: "))["choices"][0]
        out["chunks"] += 1
        delta = choice["delta"]
        out["content"] += delta.get("content") or ""
        out["reasoning"] += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            entry = out["calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
        out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def reads(choices: list[GenerateStreamChoice], rnd: random.Random) -> list[list[tuple[int, GenerateStreamChoice]]]:
    """The events grouped as engine reads might bring them in (one to five per read)."""
    out, i = [], 0
    while i < len(choices):
        step = rnd.randint(1, 5)
        out.append([(0, msgspec.structs.replace(c)) for c in choices[i:i + step]])
        i += step
    return out


@pytest.mark.parametrize("seed", range(4))
def test_coalesced_reads_fold_to_the_same_message_in_fewer_chunks(seed):
    one_by_one, coalesced = responders("reasoning")
    rnd = random.Random(seed)
    engine_events = events(output_ids(), rnd, "stop")
    singly = b"".join(one_by_one.stream_events(0, msgspec.structs.replace(c)) for c in engine_events)
    batched = b"".join(coalesced.stream_batch(batch) for batch in reads(engine_events, rnd))
    a, b = fold(singly), fold(batched)
    assert b["chunks"] < a["chunks"]
    assert {k: v for k, v in a.items() if k != "chunks"} == {k: v for k, v in b.items() if k != "chunks"}
    assert b["calls"][0]["name"] == "get_weather" and b["reasoning"] and b["finish"] == "tool_calls"
    assert coalesced.all_done and one_by_one.all_done


@pytest.mark.parametrize("request_fields", [{"stop": ["Paris"]}, {"logprobs": True}])
def test_reads_with_stop_strings_or_logprobs_keep_every_event_apart(request_fields):
    one_by_one, batched = responders("reasoning", **request_fields)
    rnd = random.Random(3)
    engine_events = events(output_ids(), rnd, "length")
    for choice in engine_events:
        choice.logprobs = GenerateLogprobs(content=[GenerateTokenLogprob(token_id=t, logprob=-1.0)
                                                    for t in choice.token_ids]) \
            if request_fields.get("logprobs") else None
    singly = b"".join(one_by_one.stream_events(0, msgspec.structs.replace(c)) for c in engine_events)
    assert b"".join(batched.stream_batch(batch) for batch in reads(engine_events, rnd)) == singly
    assert one_by_one.choices[0].tokens == batched.choices[0].tokens


def test_coalesce_joins_each_choice_and_stops_at_a_finish():
    items = [(0, GenerateStreamChoice(index=0, token_ids=[1])), (0, GenerateStreamChoice(index=1, token_ids=[7])),
             (0, GenerateStreamChoice(index=0, token_ids=[2, 3])),
             (0, GenerateStreamChoice(index=0, token_ids=[4], finish_reason="length")),
             (0, GenerateStreamChoice(index=1, token_ids=[8], logprobs=GenerateLogprobs(content=[]))),
             (1, GenerateStreamChoice(index=0, token_ids=[9]))]
    merged = coalesce(items)
    assert [(p, c.index, c.token_ids, c.finish_reason) for p, c in merged] == [
        (0, 0, [1, 2, 3, 4], "length"), (0, 1, [7], None), (0, 1, [8], None), (1, 0, [9], None)]


def test_the_stream_headers_are_what_starlette_would_send():
    from starlette.responses import StreamingResponse

    from render_service.gateway.sse_relay import SSE_HEADERS

    reference = StreamingResponse(iter(()), media_type="text/event-stream",
                                  headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    assert SSE_HEADERS == reference.raw_headers
