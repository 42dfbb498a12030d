"""Cohere Command A's reasoning, response, citation and action markup (``cohere_command3`` / ``cohere_command4``),
through the whole derender pipeline over Qwen3's real tokenizer (Cohere's markers spelled with ordinary tokens),
on the outputs upstream's own tests use."""

from __future__ import annotations

import json

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import resolve_auto
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold

TOOLS = [ToolSpec(name="foo", parameters={"type": "object", "properties": {"query": {"type": "string"}}}),
         ToolSpec(name="bar", parameters={"type": "object", "properties": {"x": {"type": "integer"}}})]

ONE_CALL = ('<|START_THINKING|> i will call foo with query1<|END_THINKING|><|START_ACTION|>\n[\n    {"tool_call_id": '
            '"0", "tool_name": "foo", "parameters": {"query": "query1"}}\n]\n<|END_ACTION|>')
TWO_CALLS = ('<|START_THINKING|>first I think about foo<|END_THINKING|><|START_ACTION|>\n[\n    {"tool_call_id": "0", '
             '"tool_name": "foo", "parameters": {"query": "query1"}},\n    {"tool_call_id": "1", "tool_name": "bar", '
             '"parameters": {"x": 42}}\n]\n<|END_ACTION|>')
CITATIONS = ("<|START_THINKING|>This is a rainbow <co>emoji: 🌈</co: 0:[1]><|END_THINKING|>\n"
             "<|START_RESPONSE|>foo <co>bar</co: 0:[1,2],1:[3,4]><|END_RESPONSE|>")


@pytest.fixture(scope="module")
def qwen3():
    return load_bundle(str(QWEN3_FIXTURE_DIR)).tokenizer


@pytest.mark.parametrize("name", ["cohere_command3", "cohere_command4"])
@pytest.mark.parametrize("text, calls, reasoning, content", [
    (ONE_CALL, [("foo", {"query": "query1"})], " i will call foo with query1", "\n"),
    (TWO_CALLS, [("foo", {"query": "query1"}), ("bar", {"x": 42})], "first I think about foo", "\n"),
    # citation markup in the answer is dropped; the reasoning keeps it (the reasoning stage does not read it)
    (CITATIONS, [], "This is a rainbow <co>emoji: 🌈</co: 0:[1]>", "\nfoo bar"),
    ("<|START_THINKING|>just think, no response<|END_THINKING|>", [], "just think, no response", None),
    ("<|START_RESPONSE|>no thinking<|END_RESPONSE|>", [], None, "no thinking"),
])
def test_upstream_vectors_stream_equal_to_batch(qwen3, name, text, calls, reasoning, content) -> None:
    pipeline = Pipeline(qwen3, PipelineConfig(request_id="r", reasoning_parser=name, tool_parser=name,
                                              tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    ids = qwen3.encode(text)
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == calls
    assert batch["reasoning"] == reasoning
    assert batch["content"] == content


def test_a_citation_closer_split_across_chunks_is_dropped(qwen3) -> None:
    from tests.test_tool_parsers_common import parse, parse_chunks

    text = "<|START_RESPONSE|>foo <co>bar</co: 0:[1,2],1:[3,4]> and </co: not one <b>x</b><|END_RESPONSE|>"
    whole = parse("cohere_command3", text)
    assert parse_chunks("cohere_command3", list(text)) == whole
    assert whole.content == "foo bar and </co: not one <b>x</b>"


def test_a_span_holding_more_than_a_source_list_is_text() -> None:
    # found by the invariants' adversarial soup: the closer's span only ever holds source indexes
    from tests.test_tool_parsers_common import parse

    assert parse("cohere_command3", '</co:"get_weather">').content == '</co:"get_weather">'


def test_auto_picks_cohere_from_the_template_markers() -> None:
    template = "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{{ '<|START_ACTION|>' + calls + '<|END_ACTION|>' }}"
    assert resolve_auto("auto", "auto", template, None) == ("cohere_command3", "cohere_command3")
