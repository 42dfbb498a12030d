"""Wire structs: vLLM's shapes decode, our output re-decodes, optional keys appear only when set."""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.wire.protocol import (
    ChatCompletionRequest,
    DerenderChatRequest,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
)
from tests.render_harness import VLLM_PAIRS, load_pair


def test_recorded_vllm_render_output_decodes_and_round_trips():
    _, recorded = load_pair(VLLM_PAIRS / "parsers" / "05_chat_render_sampling_params.request.json")
    raw = json.dumps(recorded["body"]).encode()
    request = msgspec.json.decode(raw, type=GenerateRequest)
    assert request.sampling_params.max_tokens == 256 and request.sampling_params.logprobs == 2
    again = json.loads(msgspec.json.encode(request))
    # nothing lost, and only vLLM 0.33's parse_context (null for a request that carries none) added
    assert again == {**recorded["body"], "parse_context": None}
    assert list(again).index("parse_context") == list(again).index("output_mode") + 1  # where 0.33 puts it


def test_sampling_params_omit_unset_and_default_fields():
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    encoded = json.loads(msgspec.json.encode(SamplingParams(temperature=0.0, n=2, skip_special_tokens=False)))
    assert encoded == {"n": 2, "temperature": 0.0, "skip_special_tokens": False}


def test_generate_request_key_order_starts_like_vllms():
    body = json.loads(msgspec.json.encode(GenerateRequest(request_id="r", token_ids=[1], render_fingerprint="fp1-x")))
    assert list(body)[:6] == ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params"]
    assert list(body)[-1] == "render_fingerprint"
    assert "assistant_tokens_mask" not in body and "return_token_logprobs" not in body


@pytest.mark.parametrize("response", [
    # older (<= 0.31): no output_mode, OpenAI-style logprobs with token_id:N placeholders
    {"request_id": "generate-tokens-1", "model": "m", "created": 1, "usage": {"prompt_tokens": 3, "completion_tokens": 1,
     "total_tokens": 4}, "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [5],
     "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1, "bytes": None, "top_logprobs": []}]}}]},
    # newer (0.32+): output_mode, prompt_token_ids, integer logprobs, sampling_mask, weight_versions
    {"request_id": "generate-tokens-2", "output_mode": "tokens", "prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "finish_reason": "length", "token_ids": [5], "sampling_mask": None, "weight_versions": [],
         "logprobs": {"content": [{"token_id": 5, "logprob": -0.1, "rank": 1, "top_logprobs": []}], "sampled": None}}],
     "metrics": None, "mm_placeholders": None},
])
def test_generate_response_accepts_old_and_new_shapes(response):
    decoded = msgspec.json.decode(json.dumps(response).encode(), type=GenerateResponse)
    assert decoded.choices[0].token_ids == [5]


def test_requests_ignore_unknown_fields():
    body = {"messages": [{"role": "user", "content": "x"}], "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {}}
    assert msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest).messages[0]["content"] == "x"
    derender = {"generate_response": {"request_id": "g", "choices": []}, "future_key": [1, 2]}
    assert msgspec.json.decode(json.dumps(derender).encode(), type=DerenderChatRequest).stream is False
