"""Bad input gets vLLM's error envelope and a 4xx: never a 500, never a hang."""

from __future__ import annotations

import dataclasses

import pytest

from tests.render_harness import RenderServer, qwen3_config

CHAT = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def server():
    with RenderServer(qwen3_config(False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server():
    # A 64-token context window, to reach the length limits with short prompts.
    with RenderServer(qwen3_config(False, max_model_len=64)) as srv:
        yield srv


def assert_error(response, status: int, *, contains: str = "", param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert contains in error["message"]
    if param != "any":
        assert error["param"] == param
    return error


def test_malformed_json_is_400(server):
    r = server.client.post("/v1/chat/completions/render", content=b'{"messages": [', headers={"content-type": "application/json"})
    error = assert_error(r, 400, contains="Invalid JSON")
    assert error["type"] == "BadRequestError"


def test_wrong_field_type_names_the_field(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "max_tokens": "ten"})
    assert_error(r, 400, contains="Expected `int | null`", param="max_tokens")


def test_messages_of_wrong_shape_are_400(server):
    r = server.client.post("/v1/chat/completions/render", json={"messages": "hello"})
    assert_error(r, 400, param="messages")
    r = server.client.post("/v1/chat/completions/render", json={"messages": [{"content": "no role"}]})
    assert_error(r, 400)


def test_empty_messages_are_400(server):
    r = server.client.post("/v1/chat/completions/render", json={"messages": []})
    assert_error(r, 400, contains="at least one message", param="messages")


def test_unknown_model_is_404(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "model": "gpt-17"})
    error = assert_error(r, 404, contains="The model `gpt-17` does not exist.", param="model")
    assert error["type"] == "NotFoundError"
    r = server.client.post("/v1/completions/derender", json={
        "model": "gpt-17", "generate_responses": [{"request_id": "g", "choices": [{"token_ids": [1]}]}]})
    assert_error(r, 404)


def test_beam_search_is_refused(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "use_beam_search": True})
    assert_error(r, 400, contains="Beam search is not supported by the render endpoint")
    r = server.client.post("/v1/completions/render", json={"prompt": "x", "use_beam_search": True})
    assert_error(r, 400, contains="Beam search")


def test_content_type_must_be_json(server):
    r = server.client.post("/v1/chat/completions/render", content=b"{}", headers={"content-type": "text/plain"})
    assert_error(r, 400, contains="Only 'application/json' is allowed")
    ok = server.client.post("/v1/chat/completions/render", json=CHAT,
                            headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_prompt_longer_than_context_is_400(small_server):
    long_chat = {"messages": [{"role": "user", "content": "word " * 200}]}
    r = small_server.client.post("/v1/chat/completions/render", json=long_chat)
    assert_error(r, 400, contains="This model's maximum context length is 64 tokens. However, your prompt contains",
                 param="input_tokens")
    r = small_server.client.post("/v1/completions/render", json={"prompt": list(range(100, 200))})
    assert_error(r, 400, contains="maximum context length is 64")


def test_max_tokens_is_capped_by_the_context_window(small_server):
    r = small_server.client.post("/v1/completions/render", json={"prompt": [1, 2, 3, 4], "max_tokens": 60})
    assert r.status_code == 200
    assert r.json()[0]["sampling_params"]["max_tokens"] == 60
    r = small_server.client.post("/v1/completions/render", json={"prompt": [1, 2, 3, 4], "max_tokens": 64})
    assert r.json()[0]["sampling_params"]["max_tokens"] == 60  # 64 - 4 prompt tokens
    r = small_server.client.post("/v1/completions/render", json={"prompt": [1, 2, 3, 4], "max_tokens": 65})
    assert_error(r, 400, contains="max_tokens=65 cannot be greater than max_model_len=64")


def test_max_tokens_resolution_order(server):
    def resolved(**fields):
        r = server.client.post("/v1/chat/completions/render", json={**CHAT, **fields})
        assert r.status_code == 200, r.text
        return r.json()["sampling_params"]["max_tokens"], len(r.json()["token_ids"])

    got, prompt_len = resolved()
    assert got == 40960 - prompt_len  # no generation_config max_new_tokens in Qwen3's bundle
    assert resolved(max_tokens=100)[0] == 100
    assert resolved(max_tokens=100, max_completion_tokens=7)[0] == 7


def test_template_errors_are_400(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "add_generation_prompt": True,
                                                                 "continue_final_message": True})
    assert_error(r, 400, contains="continue_final_message and add_generation_prompt are not compatible")
    trusting = dataclasses.replace(qwen3_config(False), trust_request_chat_template=True)
    with RenderServer(trusting) as srv:
        raising = "{{ raise_exception('no system prompts here') }}"
        r = srv.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": raising})
        assert_error(r, 400, contains="no system prompts here")
        r = srv.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": "{% if %}"})
        assert_error(r, 400, contains="Invalid chat template")
        r = srv.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": "{{ messages[0].nope.deeper }}"})
        assert_error(r, 400)
        recursing = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"  # unbounded: Python's recursion limit
        r = srv.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": recursing})
        assert_error(r, 400, contains="RecursionError")
        assert srv.client.get("/health").status_code == 200
        ok = srv.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": "{{ messages[0].content }}"})
        assert ok.status_code == 200
        assert ok.json()["token_ids"] == [9707]  # "Hello"


def test_request_chat_template_needs_trust_flag(server):
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "chat_template": "{{ messages }}"})
    assert_error(r, 400, contains="--trust-request-chat-template", param="chat_template")


def test_auto_tool_choice_without_parser_is_400(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "tools": tools})
    assert_error(r, 400, contains='"auto" tool choice requires --enable-auto-tool-choice')
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "tools": tools,
                                                                 "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert_error(r, 400, contains="Tool 'nope' has not been passed", param="tool_choice")
    r = server.client.post("/v1/chat/completions/render", json={**CHAT, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200


def test_sampling_values_out_of_range_are_400(server):
    for field, value in (("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("min_p", 2),
                         ("presence_penalty", 3), ("repetition_penalty", 0), ("top_k", -5), ("seed", 2**64),
                         ("stop_token_ids", [-1]), ("stop_token_ids", [151936]), ("priority", 2**63)):
        r = server.client.post("/v1/chat/completions/render", json={**CHAT, field: value})
        assert_error(r, 400, param=field)


def test_completion_prompt_shapes_are_checked(server):
    for prompt in ([], [[]], [1, "a"], {"text": "x"}, [[1, 2], "x"], [-1, 5], [10**9]):
        r = server.client.post("/v1/completions/render", json={"prompt": prompt})
        assert_error(r, 400)
    r = server.client.post("/v1/completions/render", json={"prompt": "x", "suffix": "y"})
    assert_error(r, 400, contains="suffix")
    r = server.client.post("/v1/completions/render", json={"prompt": ""})
    assert_error(r, 400, contains="No token_ids rendered")


def test_derender_rejects_untrusted_token_structures(server):
    def derender(choices, **extra):
        body = {"generate_response": {"request_id": "g", "choices": choices}, **extra}
        return server.client.post("/v1/chat/completions/derender", json=body)

    assert_error(derender([{"index": 0, "token_ids": []}]), 400, contains="choice 0 has empty or null token_ids")
    assert_error(derender([{"index": 0, "token_ids": None}]), 400, contains="empty or null")
    assert_error(derender([{"index": 0, "token_ids": [151936 + 5]}]), 400, contains="outside the model's vocabulary")
    assert_error(derender([{"index": 0, "token_ids": [-3]}]), 400)
    assert_error(derender([{"index": 0, "token_ids": [1] * 40961}]), 400, contains="exceeds max_model_len")
    assert_error(derender([{"index": 0, "token_ids": [1]}], prompt_token_ids=[1] * 40961), 400,
                 contains="prompt_token_ids length")
    assert_error(derender([{"index": 0, "token_ids": [1],
                            "logprobs": {"content": [{"token_id": 1, "logprob": -1.0,
                                                      "top_logprobs": [{"token_id": 2}] * 21}]}}]),
                 400, contains="top_logprobs")
    r = server.client.post("/v1/chat/completions/derender", json={"generate_response": {
        "request_id": "g", "output_mode": "text", "choices": [{"token_ids": [1], "text": "x"}]}})
    assert_error(r, 400, param="output_mode")


# Engine logprobs of the wrong shape, and the path (below the choice) the 400 names.
MALFORMED_LOGPROBS = [
    ([1, 2], "logprobs"),
    ({"content": "x"}, "logprobs.content"),
    ({"content": [{"token_id": "5", "logprob": -1.0}]}, "logprobs.content[0].token_id"),
    ({"content": [{"token": 5, "logprob": -1.0}]}, "logprobs.content[0].token"),
    ({"content": [{"token_id": 5, "logprob": "low"}]}, "logprobs.content[0].logprob"),
    ({"content": [{"token_id": 5, "logprob": True}]}, "logprobs.content[0].logprob"),
    ({"content": [{"token_id": 5, "logprob": -1.0, "top_logprobs": [7]}]}, "logprobs.content[0].top_logprobs[0]"),
    ({"content": [{"token_id": 5, "logprob": -1.0, "top_logprobs": {"5": -1.0}}]},
     "logprobs.content[0].top_logprobs"),
]
# Each derender endpoint that takes engine output: its path, the body around one choice, where the choice sits.
DERENDER_BODIES = {
    "chat": ("/v1/chat/completions/derender",
             lambda c: {"generate_response": {"request_id": "g", "choices": [c]}}, "generate_response.choices[0]."),
    "chat stream": ("/v1/chat/completions/derender",
                    lambda c: {"stream": True, "generate_chunk": {"request_id": "g", "choices": [c]}},
                    "generate_chunk.choices[0]."),
    "completions": ("/v1/completions/derender",
                    lambda c: {"generate_responses": [{"request_id": "g", "choices": [c]}]},
                    "generate_responses[0].choices[0]."),
    "completions stream": ("/v1/completions/derender",
                           lambda c: {"stream": True, "generate_chunk": {"request_id": "g", "choices": [c]}},
                           "generate_chunk.choices[0]."),
    "responses": ("/v1/responses/derender",
                  lambda c: {"generate_response": {"request_id": "g", "choices": [c]}}, "generate_response.choices[0]."),
    "responses stream": ("/v1/responses/derender",
                         lambda c: {"stream": True, "generate_chunk": {"request_id": "g", "choices": [c]}},
                         "generate_chunk.choices[0]."),
}


@pytest.mark.parametrize("endpoint", DERENDER_BODIES)
@pytest.mark.parametrize(("logprobs", "path"), MALFORMED_LOGPROBS)
def test_malformed_engine_logprobs_are_400_naming_the_field(server, endpoint, logprobs, path):
    url, body, at = DERENDER_BODIES[endpoint]
    r = server.client.post(url, json=body({"index": 0, "token_ids": [9707], "logprobs": logprobs}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == at + path and at + path in error["message"]
    assert error["type"] == ("invalid_request_error" if endpoint.startswith("responses") else "BadRequestError")


def test_malformed_engine_logprobs_are_400_on_messages_in_anthropics_shape(server):
    r = server.client.post("/v1/messages/derender", json={"generate_response": {"request_id": "g", "choices": [
        {"index": 0, "token_ids": [9707], "logprobs": {"content": [{"token_id": 5, "logprob": "low"}]}}]}})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "generate_response.choices[0].logprobs.content[0].logprob" in r.json()["error"]["message"]


@pytest.mark.parametrize(("prompt_logprobs", "path"), [
    ({"5": {"logprob": -1.0}}, "prompt_logprobs"),
    ([None, {"x": {"logprob": -1.0}}], "prompt_logprobs[1]"),
    ([None, {"5": -1.0}], "prompt_logprobs[1][...]"),
    ([None, {"5": {"logprob": -1.0, "rank": "first"}}], "prompt_logprobs[1][...].rank"),
])
def test_malformed_prompt_logprobs_are_400_naming_the_field(server, prompt_logprobs, path):
    r = server.client.post("/v1/chat/completions/derender", json={"generate_response": {
        "request_id": "g", "choices": [{"index": 0, "token_ids": [9707]}], "prompt_logprobs": prompt_logprobs}})
    assert_error(r, 400, contains=path, param="generate_response." + path)


def test_well_formed_logprobs_of_both_shapes_and_prompt_logprobs_pass(server):
    """Ints where floats go, null ranks and missing optional keys are vLLM's shapes, not errors."""
    r = server.client.post("/v1/chat/completions/derender", json={"chat_request": {**CHAT, "logprobs": True}, "generate_response": {
        "request_id": "g", "prompt_logprobs": [None, {"9707": {"logprob": -1, "rank": None}}],
        "choices": [{"index": 0, "token_ids": [9707, 1879], "logprobs": {"content": [
            {"token_id": 9707, "logprob": -1, "rank": None, "top_logprobs": [{"token_id": 9707, "logprob": -1}]},
            {"token": "token_id:1879", "logprob": -0.5, "bytes": None, "top_logprobs": []}], "sampled": None}}]}})
    assert r.status_code == 200, r.text
    answer = r.json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["token_id"], e["logprob"]) for e in content] == [("Hello", 9707, -1.0), (" world", 1879, -0.5)]
    assert answer["prompt_logprobs"] == [None, {"9707": {"logprob": -1.0, "rank": None, "decoded_token": None}}]


def test_completions_derender_checks_list_lengths(server):
    gen = {"request_id": "g", "choices": [{"index": 0, "token_ids": [9707]}]}
    r = server.client.post("/v1/completions/derender", json={"generate_responses": []})
    assert_error(r, 400, contains="must not be empty")
    r = server.client.post("/v1/completions/derender", json={"generate_responses": [gen], "prompt_tokens": [1, 2]})
    assert_error(r, 400, param="prompt_tokens")


def test_unknown_route_and_method_use_the_envelope(server):
    assert_error(server.client.get("/v1/nothing-here"), 404)
    assert_error(server.client.get("/v1/chat/completions/render"), 405)


def test_api_key_protects_everything_but_health():
    with RenderServer(qwen3_config(False), api_key="sekret") as srv:
        assert_error(srv.client.post("/v1/chat/completions/render", json=CHAT), 401)
        assert_error(srv.client.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401)
        ok = srv.client.post("/v1/chat/completions/render", json=CHAT, headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert srv.client.get("/health").status_code == 200


def test_deeply_nested_json_is_400(server):
    deep = b'{"messages": [{"role": "user", "content": ' + b"[" * 100000 + b"]" * 100000 + b"}]}"
    r = server.client.post("/v1/chat/completions/render", content=deep, headers={"content-type": "application/json"})
    assert_error(r, 400, contains="nested too deeply")


def test_chat_template_kwargs_override_template_arguments_like_vllm(server):
    hi = [{"role": "user", "content": "hi"}]
    plain = server.client.post("/v1/chat/completions/render", json={"messages": hi, "add_generation_prompt": False})
    overridden = server.client.post("/v1/chat/completions/render", json={
        "messages": hi, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert overridden.json()["token_ids"] == plain.json()["token_ids"]
    assert_error(server.client.post("/v1/chat/completions/render", json={
        "messages": hi, "chat_template_kwargs": {"tools": 5}}), 400, contains="Tools should be a list")
    assert_error(server.client.post("/v1/chat/completions/render", json={
        "messages": hi, "chat_template_kwargs": {"messages": []}}), 400, param="chat_template_kwargs")


def test_derender_refuses_a_malformed_tool_choice():
    with RenderServer(qwen3_config(True)) as srv:
        for choice in ({"function": 5}, {"type": "function"}, "sometimes"):
            r = srv.client.post("/v1/chat/completions/derender", json={
                "generate_response": {"request_id": "g", "choices": [{"token_ids": [151657, 9707]}]},
                "chat_request": {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}})
            assert_error(r, 400, param="tool_choice")


@pytest.mark.parametrize("past", [151669, 151700, 151935])  # Qwen3's tokenizer ends at 151668, its vocab_size is 151936
def test_derender_drops_ids_between_the_tokenizer_and_vocab_size_as_vllm(server, past):
    # an engine may sample them (the model's head has those rows); vLLM decodes them to nothing, and so do we
    # (tests/test_vllm_render_parity.py compares with vLLM's render server where the peer is installed)
    def texts(ids):
        gen = {"request_id": "g", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]}
        chat = server.client.post("/v1/chat/completions/derender", json={
            "chat_request": {"messages": [{"role": "user", "content": "hi"}],
                             "chat_template_kwargs": {"enable_thinking": False}}, "generate_response": gen})
        text = server.client.post("/v1/completions/derender", json={"stream": True, "generate_chunk": gen})
        assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
        return chat.json()["choices"][0]["message"]["content"], text.json()["chunk"]["choices"][0]["text"]

    assert texts([9707, past, 11]) == texts([9707, 11]) == ("Hello,", "Hello,")
