"""MiniMax-M3's namespaced element calls (``minimax_m3``) on upstream's own test vectors, and through the whole
derender pipeline over Qwen3's real tokenizer (M3's namespace marker spelled with ordinary tokens)."""

from __future__ import annotations

import json

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import resolve_auto
from render_service.parsers.base import ToolParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import parse, parse_chunks

NS = "]<]minimax[>["
PARAMS = {"type": "object", "properties": {
    "user_id": {"type": "integer"}, "urgent": {"type": "boolean"}, "note": {"type": "string"},
    "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}}}},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "duplicate_demo": {"type": "object"}}}
TOOLS = ToolParserConfig(tools=[ToolSpec(name="create_order", parameters=PARAMS)])

ORDER = (f"{NS}<tool_call>\n" f'{NS}<invoke name="create_order">' f"{NS}<user_id>42{NS}</user_id>"
         f"{NS}<urgent>true{NS}</urgent>" f"{NS}<note>Please leave at front desk.{NS}</note>" f"{NS}<shipping>"
         f"{NS}<city>Singapore{NS}</city>" f"{NS}<zip>018956{NS}</zip>" f"{NS}</shipping>" f"{NS}<items>"
         f"{NS}<item>{NS}<sku>book-001{NS}</sku>{NS}<qty>2{NS}</qty>{NS}</item>"
         f"{NS}<item>{NS}<sku>pen-007{NS}</sku>{NS}<qty>5{NS}</qty>{NS}</item>" f"{NS}</items>" f"{NS}<metadata>"
         f"{NS}<source>mobile{NS}</source>" f"{NS}<campaign>may-launch{NS}</campaign>" f"{NS}</metadata>"
         f"{NS}<duplicate_demo>" f"{NS}<tag>a{NS}</tag>" f"{NS}<tag>b{NS}</tag>" f"{NS}</duplicate_demo>"
         f"{NS}</invoke>\n" f"{NS}</tool_call>")
ORDER_ARGS = {"user_id": 42, "urgent": True, "note": "Please leave at front desk.",
              "shipping": {"city": "Singapore", "zip": 18956},
              "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
              "metadata": {"source": "mobile", "campaign": "may-launch"}, "duplicate_demo": {"tag": ["a", "b"]}}


def _invocation(user_id: int) -> str:
    return f'{NS}<invoke name="create_order">{NS}<user_id>{user_id}{NS}</user_id>{NS}</invoke>'


def test_nested_call_is_read_as_upstream_reads_it() -> None:
    text = "I will create it.\n" + ORDER
    folded = parse("minimax_m3", text, TOOLS)
    assert parse_chunks("minimax_m3", list(text), TOOLS) == folded
    assert folded.content == "I will create it.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [("create_order", ORDER_ARGS)]


def test_two_invocations_in_one_block() -> None:
    text = f"{NS}<tool_call>\n{_invocation(1)}\n{_invocation(2)}\n{NS}</tool_call>"
    folded = parse("minimax_m3", text, TOOLS)
    assert parse_chunks("minimax_m3", list(text), TOOLS) == folded
    assert folded.content is None
    assert [json.loads(c["arguments"])["user_id"] for c in folded.calls] == [1, 2]


def test_without_a_call_everything_is_content() -> None:
    assert parse("minimax_m3", "plain response", TOOLS).content == "plain response"


def test_a_call_is_sent_whole_when_its_invoke_ends() -> None:
    from render_service.parsers.registry import get_tool_parser

    parser = get_tool_parser("minimax_m3")(TOOLS)
    state = parser.initial_state()
    assert parser.feed(state, ORDER[: ORDER.index(f"{NS}</invoke>")]) == []
    assert [p.name for p in parser.feed(state, ORDER[ORDER.index(f"{NS}</invoke>"):])] == ["create_order"]


def test_pipeline_one_token_streaming_equals_batch() -> None:
    tok = load_bundle(str(QWEN3_FIXTURE_DIR)).tokenizer
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="minimax_m3", tool_parser="minimax_m3",
                                            tool_choice="auto", tools=list(TOOLS.tools), skip_special_tokens=False))
    ids = tok.encode("<mm:think>Order it 😀.</mm:think>I will create it.\n" + ORDER)
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert batch["reasoning"] == "Order it 😀." and batch["content"] == "I will create it.\n"
    assert json.loads(batch["tool_calls"][0]["function"]["arguments"]) == ORDER_ARGS


def test_auto_reads_the_namespace_marker() -> None:
    template = "{{- ']<]minimax[>[<tool_call>' }}"
    assert resolve_auto("auto", "auto", template, None) == ("minimax_m3", "minimax_m3")
