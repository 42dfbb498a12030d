"""Inkling's typed blocks (``inkling`` reasoning and tools) through the whole derender pipeline over Qwen3's real
tokenizer (Inkling's markers spelled with ordinary tokens): one-token streaming equals batch."""

from __future__ import annotations

import json

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold

TOOLS = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})]
THINK, TEXT, CALL, END, MODEL = ("<|content_thinking|>", "<|content_text|>", "<|content_invoke_tool_json|>",
                                 "<|end_message|>", "<|message_model|>")


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (f'{THINK}Need SF 😀.{END}{MODEL}{TEXT}Checking.{END}{MODEL}{CALL}{{"name": "get_weather", "args": '
     f'{{"city": "SF 🌧"}}}}{END}', "Need SF 😀.", "Checking.", [("get_weather", {"city": "SF 🌧"})]),
    (f"{MODEL}{TEXT}Just text.{END}", None, "Just text.", []),
    # thinking cut by a call block: reasoning ends there
    (f'{MODEL}{THINK}Need SF{CALL}{{"name": "get_weather", "args": {{}}}}{END}', "Need SF", None,
     [("get_weather", {})]),
])
def test_inkling_stream_equals_batch(text, reasoning, content, calls) -> None:
    tok = load_bundle(str(QWEN3_FIXTURE_DIR)).tokenizer
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="inkling", tool_parser="inkling",
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    ids = tok.encode(text)
    batch, _ = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == calls
    assert batch["reasoning"] == reasoning
    assert batch["content"] == content
