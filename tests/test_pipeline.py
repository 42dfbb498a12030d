"""Pipeline: batch derender is the fold of streaming derender, for every chunking and parser combination."""

from __future__ import annotations

import json
from functools import lru_cache

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import (
    MessageAccumulator,
    Pipeline,
    PipelineConfig,
    PipelineState,
    derender_all,
    tool_call_id,
)
from render_service.tokenize.byte_level import BYTE_TO_CHAR
from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR

QWEN = str(SHARED / "fixtures/qwen3-0.6b")
EOS = 151645
TOOLS = [ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
         ToolSpec("search", {"type": "object", "properties": {"q": {"type": "string"}}})]


@lru_cache(maxsize=1)
def qwen():
    return load_bundle(QWEN).tokenizer


def byte_ids(text: str) -> list[int]:
    """``text`` spelled with single-byte tokens: tags and emoji split across tokens."""
    tok = qwen()
    table = BYTE_TO_CHAR
    return [tok.token_to_id(table[b]) for b in text.encode()]


def stream_fold(pipeline: Pipeline, ids: list[int], cuts: list[int], prompt=None, hint=None) -> dict:
    state = pipeline.initial_state(prompt, hint)
    acc = MessageAccumulator()
    start = 0
    for c in [*cuts, len(ids)]:
        # each chunk also crosses the wire: the state is serialized and restored in between
        state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
        acc.add(pipeline.feed(state, ids[start:c]))
        start = c
    acc.add(pipeline.finish(state))
    return acc.message(pipeline.config.tool_choice in ("named", "required"))


SCENARIOS = {
    # name: (config kwargs, output text)
    "qwen3_reasoning_content_tool": (
        dict(reasoning_parser="qwen3", tool_parser="hermes", tool_choice="auto", tools=TOOLS),
        '<think>\nNeed weather 😀.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Seoul 🌧"}}\n</tool_call>',
    ),
    "qwen3_two_calls": (
        dict(reasoning_parser="qwen3", tool_parser="hermes", tool_choice="auto", tools=TOOLS),
        '<think>x</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "b}c"}}\n</tool_call>',
    ),
    "qwen3_truncated_reasoning": (dict(reasoning_parser="qwen3"), "<think>\nStep 1: 中文 consider <thi"),
    "qwen3_no_tools_markup_stays_content": (
        dict(reasoning_parser="qwen3"), '<think>a</think>b<tool_call>\n{"name": "f"}\n</tool_call>'),
    "r1_no_start_tag": (dict(reasoning_parser="deepseek_r1"), "  plan 😀</think>answer </think> more"),
    "v3_thinking": (dict(reasoning_parser="deepseek_v3", enable_thinking=True), "x</think>y"),
    "v3_identity": (dict(reasoning_parser="deepseek_v3", enable_thinking=False), "<think>x</think>y"),
    "plain": (dict(), "Hello 👩‍👩‍👧 world <think>"),
    "required": (
        dict(reasoning_parser="qwen3", tool_choice="required", tools=TOOLS),
        '<think>r</think>[{"name": "get_weather", "parameters": {"city": "Paris \\"}\\""}}, '
        '{"parameters": {"q": [1, {"a": "]"}]}, "name": "search"}]',
    ),
    "named": (
        dict(reasoning_parser="qwen3", tool_choice="named", named_function="get_weather", tools=TOOLS),
        '<think>r</think>{"city": "Paris 😀"}',
    ),
    "hermes_without_reasoning": (
        dict(tool_parser="hermes", tool_choice="auto", tools=TOOLS),
        'Sure <tool_c <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
    ),
}


@st.composite
def spelled_ids(draw, text: str) -> list[int]:
    """Token ids for ``text``: each piece either normally tokenized or byte by byte."""
    tok = qwen()
    pieces, i = [], 0
    while i < len(text):
        j = draw(st.integers(i + 1, min(len(text), i + 12)))
        pieces.append(text[i:j])
        i = j
    ids: list[int] = []
    for p in pieces:
        ids += byte_ids(p) if draw(st.booleans()) else tok.encode(p)
    return ids


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stream_fold_equals_batch_for_random_chunks(name):
    kwargs, text = SCENARIOS[name]
    pipeline = Pipeline(qwen(), PipelineConfig(request_id="req-1", **kwargs))
    batch, _ = derender_all(pipeline, qwen().encode(text))

    @settings(max_examples=25, deadline=None)
    @given(st.data())
    def check(data):
        ids = data.draw(spelled_ids(text))
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1)), max_size=len(ids))))
        assert stream_fold(pipeline, ids, cuts) == batch
        assert derender_all(pipeline, ids)[0] == batch

    check()


def test_qwen3_hermes_scenario_values():
    kwargs, text = SCENARIOS["qwen3_reasoning_content_tool"]
    pipeline = Pipeline(qwen(), PipelineConfig(request_id="req-1", **kwargs))
    msg, state = derender_all(pipeline, qwen().encode(text) + [EOS])
    assert msg["reasoning"] == "\nNeed weather 😀.\n"
    assert msg["content"] == "\n\nChecking.\n"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Seoul 🌧"}
    assert call["id"] == tool_call_id("req-1", 0, 0)
    assert pipeline.finish_reason(state, "stop") == "tool_calls"
    assert pipeline.finish_reason(state, "length") == "length"


def test_required_and_named_values():
    kwargs, text = SCENARIOS["required"]
    msg, state = derender_all(Pipeline(qwen(), PipelineConfig(request_id="r", **kwargs)), qwen().encode(text))
    assert msg["content"] == "" and msg["reasoning"] == "r"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "search"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": 'Paris "}"'}
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"q": [1, {"a": "]"}]}
    kwargs, text = SCENARIOS["named"]
    pipeline = Pipeline(qwen(), PipelineConfig(request_id="r", **kwargs))
    msg, state = derender_all(pipeline, qwen().encode(text))
    assert msg["content"] == ""
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris 😀"}'}
    assert pipeline.finish_reason(state, "stop") == "stop"  # V-C01: named keeps "stop"


def test_tool_choice_none_leaves_markup_in_content():
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    pipeline = Pipeline(qwen(), PipelineConfig(tool_parser="hermes", tool_choice="none", tools=TOOLS))
    msg, state = derender_all(pipeline, qwen().encode(text))
    assert msg["content"] == text and msg["tool_calls"] == []
    assert pipeline.finish_reason(state, "stop") == "stop"


def test_include_reasoning_false_drops_reasoning_only():
    pipeline = Pipeline(qwen(), PipelineConfig(reasoning_parser="qwen3", include_reasoning=False))
    msg, _ = derender_all(pipeline, qwen().encode("<think>secret</think>answer"))
    assert msg["reasoning"] is None and msg["content"] == "answer"


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    kwargs, text = SCENARIOS["qwen3_two_calls"]
    pipeline = Pipeline(qwen(), PipelineConfig(parallel_tool_calls=False, **kwargs))
    msg, _ = derender_all(pipeline, qwen().encode(text))
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_prompt_that_closed_reasoning_makes_output_content():
    tok = qwen()
    prompt = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    pipeline = Pipeline(tok, PipelineConfig(reasoning_parser="qwen3"))
    msg, _ = derender_all(pipeline, tok.encode("Paris."), prompt_token_ids=prompt)
    assert msg["content"] == "Paris." and msg["reasoning"] is None
    # a render-side hint does the same without the prompt
    msg, _ = derender_all(pipeline, tok.encode("Paris."), reasoning_open_at_start=False)
    assert msg["content"] == "Paris."
    # enable_thinking=False from chat_template_kwargs
    off = Pipeline(tok, PipelineConfig(reasoning_parser="qwen3", enable_thinking=False))
    assert derender_all(off, tok.encode("Paris."))[0]["content"] == "Paris."


def test_tool_call_ids_are_deterministic_per_request_choice_and_call():
    a = tool_call_id("req", 0, 0)
    assert a == tool_call_id("req", 0, 0)
    assert len({a, tool_call_id("req", 1, 0), tool_call_id("req", 0, 1), tool_call_id("other", 0, 0)}) == 4
    assert a.startswith("chatcmpl-tool-") and len(a) == len("chatcmpl-tool-") + 32


def test_n_choices_have_independent_states_and_ids():
    kwargs, text = SCENARIOS["qwen3_reasoning_content_tool"]
    ids = qwen().encode(text)
    msgs = [derender_all(Pipeline(qwen(), PipelineConfig(request_id="r", choice_index=i, **kwargs)), ids)[0]
            for i in range(2)]
    assert msgs[0]["content"] == msgs[1]["content"]
    assert msgs[0]["tool_calls"][0]["id"] != msgs[1]["tool_calls"][0]["id"]


def test_eos_is_hidden_and_finish_is_idempotent():
    tok = qwen()
    pipeline = Pipeline(tok, PipelineConfig(skip_special_tokens=False, hidden_token_ids=frozenset({EOS})))
    state = pipeline.initial_state()
    assert pipeline.feed(state, tok.encode("ok") + [EOS]).content == "ok"
    pipeline.finish(state)
    assert pipeline.finish(state).is_empty()


def test_state_is_small_and_history_free():
    kwargs, text = SCENARIOS["qwen3_reasoning_content_tool"]
    pipeline = Pipeline(qwen(), PipelineConfig(**kwargs))
    state = pipeline.initial_state()
    sizes = []
    for t in qwen().encode(text * 3):
        pipeline.feed(state, [t])
        sizes.append(len(msgspec.msgpack.encode(state)))
    assert isinstance(state, PipelineState)
    assert max(sizes) < 400
