"""The render server's endpoints over real HTTP: shapes, ids, tokenize/detokenize, metrics."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

from tests.render_harness import QWEN3_DIR, RenderServer, qwen3_config

CHAT = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "What is 2+2?"}]}


@pytest.fixture(scope="module")
def server():
    with RenderServer(qwen3_config(False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf():
    return Tokenizer.from_file(str(QWEN3_DIR / "tokenizer.json"))


def test_chat_render_ids_are_vllm_shaped(server):
    body = server.client.post("/v1/chat/completions/render", json=CHAT).json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["request_id"])
    other = server.client.post("/v1/chat/completions/render", json=CHAT).json()
    assert other["request_id"] != body["request_id"]


def test_request_id_comes_from_header_then_body(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "request_id": "body-id"},
                           headers={"x-request-id": "hdr-id"})
    assert r.json()["request_id"] == "chatcmpl-hdr-id"
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "request_id": "body-id"})
    assert r.json()["request_id"] == "chatcmpl-body-id"
    r = server.client.post("/v1/completions/render", json={"prompt": ["a", "b"]}, headers={"x-request-id": "x"})
    assert [g["request_id"] for g in r.json()] == ["cmpl-x-0", "cmpl-x-1"]


def test_completion_render_accepts_all_four_prompt_shapes(server, hf):
    text_ids = hf.encode("The capital of Korea is", add_special_tokens=False).ids
    for prompt, expected in (
        ("The capital of Korea is", [text_ids]),
        (["The capital of Korea is", "x"], [text_ids, hf.encode("x", add_special_tokens=False).ids]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ):
        r = server.client.post("/v1/completions/render", json={"prompt": prompt})
        assert r.status_code == 200, r.text
        assert [g["token_ids"] for g in r.json()] == expected
        assert all(g["sampling_params"]["max_tokens"] == 16 for g in r.json())  # CompletionRequest default


def test_unknown_request_fields_are_ignored(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "some_future_field": {"x": 1}, "metadata": 3})
    assert r.status_code == 200


def test_stream_flags_and_output_kind(server):
    plain = server.client.post("/v1/chat/completions/render", json=CHAT).json()
    assert plain["stream"] is False and plain["stream_options"] is None
    assert plain["sampling_params"]["output_kind"] == 2
    streamed = server.client.post("/v1/chat/completions/render", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}}).json()
    assert streamed["stream"] is True
    assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert streamed["sampling_params"]["output_kind"] == 1  # vLLM: DELTA when streaming
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_kv_transfer_params_travel_at_the_top_level_as_in_vllm_033(server):
    # 0.32 put a chat request's params in sampling_params.extra_args; 0.33 (and both releases' engines) the top level
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    body = server.client.post("/v1/chat/completions/render", json={**CHAT, "kv_transfer_params": params}).json()
    assert body["kv_transfer_params"] == params and "extra_args" not in body["sampling_params"]
    [prompt] = server.client.post("/v1/completions/render", json={"prompt": "Hi", "kv_transfer_params": params}).json()
    assert prompt["kv_transfer_params"] == params and "extra_args" not in prompt["sampling_params"]
    assert prompt["parse_context"] is None


def test_sampling_params_follow_the_request_over_generation_config(server):
    sp = server.client.post("/v1/chat/completions/render", json={
        **CHAT, "temperature": 0.5, "top_k": -1, "n": 2, "ignore_eos": True, "stop": "END", "min_tokens": 3,
        "response_format": {"type": "json_object"}}).json()["sampling_params"]
    assert sp["temperature"] == 0.5 and sp["top_k"] == -1 and sp["top_p"] == 0.95
    assert sp["n"] == 2 and sp["ignore_eos"] is True and sp["min_tokens"] == 3
    assert sp["stop"] == ["END"] and sp["output_text_buffer_length"] == 2
    assert sp["stop_token_ids"] == []  # ignore_eos: render must not add EOS ids
    assert sp["structured_outputs"] == {"json_object": True}


@pytest.mark.parametrize("spec, field", [
    ({"schema": {"type": "object"}}, "name"),
    ({"name": 7, "schema": {"type": "object"}}, "name"),
    ({"name": "x", "schema": True}, "schema"),
    ({"name": "x", "schema": ["object"]}, "schema"),
    ({"name": "x"}, "schema"),
    ({"name": "x", "schema": {}, "strict": "yes"}, "strict"),
    ({"name": "x", "schema": {}, "description": 1}, "description"),
])
def test_a_json_schema_response_format_is_checked_as_vllm_checks_it(server, spec, field):
    r = server.client.post("/v1/chat/completions/render", json={
        **CHAT, "response_format": {"type": "json_schema", "json_schema": spec}})
    assert r.status_code == 400 and f"json_schema.{field}" in r.json()["error"]["message"], r.text


def test_a_named_json_schema_response_format_becomes_the_constraint(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sp = server.client.post("/v1/chat/completions/render", json={**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True, "description": None}},
    }).json()["sampling_params"]
    assert sp["structured_outputs"] == {"json": schema}


def test_greedy_requests_leave_out_the_truncation_knobs_as_vllm(server):
    # vLLM resets top_p/top_k/min_p below temperature 1e-5 (so its render does not write them), even when asked
    for temperature in (0, 1e-6):
        sp = server.client.post("/v1/chat/completions/render", json={
            **CHAT, "temperature": temperature, "top_k": 5, "top_p": 0.5, "min_p": 0.1}).json()["sampling_params"]
        assert sp["temperature"] == temperature and not {"top_p", "top_k", "min_p"} & set(sp)
    sp = server.client.post("/v1/completions/render", json={"prompt": "Hi", "temperature": 0}).json()[0]["sampling_params"]
    assert not {"top_p", "top_k", "min_p"} & set(sp)
    sp = server.client.post("/v1/completions/render", json={"prompt": "Hi", "temperature": 1e-5}).json()[0]["sampling_params"]
    assert (sp["top_p"], sp["top_k"], sp["min_p"]) == (0.95, 20, 0.0)  # from generation_config.json


def test_tokenize_and_detokenize_round_trip(server, hf):
    text = "Hello, 세계! 😀"
    r = server.client.post("/tokenize", json={"model": "qwen3-0.6b", "prompt": text, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == hf.encode(text, add_special_tokens=False).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 40960
    assert len(body["token_strs"]) == body["count"]
    back = server.client.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_messages_equals_chat_render(server):
    rendered = server.client.post("/v1/chat/completions/render", json=CHAT).json()["token_ids"]
    tokenized = server.client.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    assert tokenized == rendered


def test_models_health_version(server):
    models = server.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["qwen3-0.6b"]
    assert models["data"][0]["max_model_len"] == 40960
    health = server.client.get("/health")
    assert health.status_code == 200 and health.content == b""
    version = server.client.get("/version").json()
    assert version["version"] and version["render_fingerprint"] == qwen3_config(False).fingerprint


def test_chat_derender_plain_detokenization(server, hf):
    ids = hf.encode("Four. 🙂", add_special_tokens=False).ids + [151645]
    r = server.client.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "generate-tokens-chatcmpl-1", "choices": [
            {"index": 0, "token_ids": ids, "finish_reason": "stop"},
            {"index": 1, "token_ids": ids[:2], "finish_reason": "length"}]},
        "prompt_tokens": 12, "kv_transfer_params": None})
    body = r.json()
    assert body["id"] == "generate-tokens-chatcmpl-1" and body["object"] == "chat.completion"
    assert [c["message"]["content"] for c in body["choices"]] == ["Four. 🙂", "Four."]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": len(ids) + 2,
                             "total_tokens": 12 + len(ids) + 2, "prompt_tokens_details": None,
                             "completion_tokens_details": None}
    assert "tool_calls" not in body["choices"][0]["message"]


def test_skip_special_tokens_false_keeps_markers_but_not_the_stop_token(server):
    ids = [151667, 9707, 151668, 151645]  # <think>Hello</think><|im_end|>
    r = server.client.post("/v1/chat/completions/derender", json={
        "generate_response": {"request_id": "g", "choices": [{"token_ids": [151644] + ids}]},
        "chat_request": {**CHAT, "skip_special_tokens": False}})
    assert r.json()["choices"][0]["message"]["content"] == "<|im_start|><think>Hello</think>"


def test_completions_derender_numbers_choices_across_responses(server):
    r = server.client.post("/v1/completions/derender", json={
        "prompt_tokens": [5, 7],
        "generate_responses": [
            {"request_id": "a", "kv_transfer_params": {"k": 1}, "choices": [{"index": 0, "token_ids": [9707]}]},
            {"request_id": "b", "kv_transfer_params": {"k": 2}, "choices": [{"index": 0, "token_ids": [1879]},
                                                                            {"index": 1, "token_ids": [0]}]}]})
    body = r.json()
    assert body["id"] == "a" and body["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Hello"), (1, " world"), (2, "!")]
    assert body["usage"]["prompt_tokens"] == 12 and body["usage"]["completion_tokens"] == 3
    assert body["kv_transfer_params"] is None  # responses disagree


def test_derender_resolves_logprobs_in_both_generate_shapes(server):
    new_shape = {"content": [{"token_id": 9707, "logprob": -0.5, "rank": 1,
                              "top_logprobs": [{"token_id": 9707, "logprob": -0.5, "rank": 1},
                                               {"token_id": 13048, "logprob": -1.5, "rank": 2}]}]}
    old_shape = {"content": [{"token": "token_id:9707", "logprob": -0.5, "bytes": None,
                              "top_logprobs": [{"token": "token_id:9707", "logprob": -0.5},
                                               {"token": "token_id:13048", "logprob": -1.5}]}]}
    for logprobs in (new_shape, old_shape):
        r = server.client.post("/v1/chat/completions/derender", json={"generate_response": {
            "request_id": "g", "choices": [{"token_ids": [9707], "logprobs": logprobs}]}})
        entry = r.json()["choices"][0]["logprobs"]["content"][0]
        assert entry["token"] == "Hello" and entry["logprob"] == -0.5 and entry["bytes"] == list(b"Hello")
        assert [t["token"] for t in entry["top_logprobs"]] == ["Hello", "Hi"]
    r = server.client.post("/v1/completions/derender", json={"generate_responses": [{
        "request_id": "g", "choices": [{"token_ids": [9707, 1879], "logprobs": {"content": [
            {"token_id": 9707, "logprob": -0.5}, {"token_id": 1879, "logprob": -0.25}]}}]}]})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hello", " world"] and lp["text_offset"] == [0, 5]
    assert lp["token_logprobs"] == [-0.5, -0.25]


def test_logprob_of_a_partial_character_is_repaired_from_context(server, hf):
    ids = hf.encode("🫠", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    content = [{"token_id": t, "logprob": -1.0} for t in ids]
    r = server.client.post("/v1/chat/completions/derender", json={"generate_response": {
        "request_id": "g", "choices": [{"token_ids": ids, "logprobs": {"content": content}}]}})
    tokens = [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]
    assert tokens == ["", "", "🫠"]  # vLLM: partial pieces are "", the completing token carries the character


def test_metrics_count_requests_and_latency(server):
    def scrape() -> str:
        return server.client.get("/metrics").text

    def value(text: str, prefix: str) -> float:
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = scrape()
    server.client.post("/v1/chat/completions/render", json=CHAT)
    server.client.post("/v1/chat/completions/render", json={**CHAT, "model": "nope"})
    after = scrape()
    ok = 'splitserve_render_requests_total{endpoint="chat_render",status="200"}'
    missing = 'splitserve_render_requests_total{endpoint="chat_render",status="404"}'
    assert value(after, ok) == value(before, ok) + 1
    assert value(after, missing) == value(before, missing) + 1
    count = 'splitserve_render_latency_seconds_count{endpoint="chat_render"}'
    assert value(after, count) == value(before, count) + 1
    assert "splitserve_derender_latency_seconds" in after


def test_vllm_render_duration_metric_is_counted_per_request_type(server):
    def count(text: str, request_type: str) -> float:
        key = f'vllm:request_render_duration_seconds_count{{model_name="qwen3-0.6b",request_type="{request_type}"}}'
        return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(key)), 0.0)

    before = server.client.get("/metrics").text
    server.client.post("/v1/chat/completions/render", json=CHAT)
    server.client.post("/v1/completions/render", json={"model": "qwen3-0.6b", "prompt": "hi"})
    after = server.client.get("/metrics").text
    assert count(after, "chat") == count(before, "chat") + 1
    assert count(after, "completion") == count(before, "completion") + 1


def test_load_reports_the_requests_in_flight_as_vllm_does(server):
    r = server.client.get("/load")
    assert r.status_code == 200 and r.json() == {"server_load": 0}


def test_a_vllm_render_route_we_do_not_serve_is_501_not_404(server):
    r = server.client.post("/cohere/v2/chat/render", json={"model": "qwen3-0.6b", "messages": []})
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "NotImplementedError" and "/cohere/v2/chat/render" in r.json()["error"]["message"]
    assert server.client.post("/v1/not/a/route", json={}).status_code == 404
