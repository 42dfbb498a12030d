"""Arbitrary JSON thrown at every POST endpoint: always a JSON answer, never a 5xx."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.render_harness import RenderServer, qwen3_config

ENDPOINTS = {
    "/v1/chat/completions/render": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions/render": {"prompt": "hi"},
    "/v1/chat/completions/derender": {"generate_response": {"request_id": "g", "choices": [{"token_ids": [9707]}]},
                                      "chat_request": {"messages": [{"role": "user", "content": "hi"}]}},
    "/v1/completions/derender": {"generate_responses": [{"request_id": "g", "choices": [{"token_ids": [9707]}]}]},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [9707]},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.sampled_from(["user", "assistant", "tool", "system", "auto", "required", "none"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


def _keys_of(body: dict) -> list[str]:
    keys = set(body)
    for value in body.values():
        if isinstance(value, dict):
            keys |= set(value)
    return sorted(keys | {"model", "tools", "tool_choice", "max_tokens", "stream", "chat_template_kwargs", "n",
                          "logprobs", "top_logprobs", "stop", "prompt_token_ids", "stream_state"})


@pytest.fixture(scope="module")
def servers():
    with RenderServer(qwen3_config(False)) as plain, RenderServer(qwen3_config(True)) as parsed:
        yield plain, parsed


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_bodies_never_get_a_5xx(servers, path, data):
    base = ENDPOINTS[path]
    body = json.loads(json.dumps(base))
    for key in data.draw(st.lists(st.sampled_from(_keys_of(base)), max_size=3)):
        target = body
        nested = [k for k, v in body.items() if isinstance(v, dict) and key in v]
        if nested and data.draw(st.booleans()):
            target = body[nested[0]]
        target[key] = data.draw(json_values)
    server = servers[data.draw(st.integers(0, 1))]
    r = server.client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    assert r.headers["content-type"].startswith("application/json")
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=json_values)
def test_any_json_document_gets_a_4xx_or_200(servers, path, value):
    r = servers[0].client.post(path, content=json.dumps(value).encode(), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, value, r.text)


@pytest.mark.parametrize("path, body", [
    # a content part whose type is not a string (the memo looks for image parts in every message it decodes)
    ("/v1/chat/completions/render", {"model": "qwen3-0.6b", "messages": [
        {"role": "user", "content": [{"type": {"an": "object"}, "text": "hi"}]}]}),
    ("/v1/chat/completions/render", {"model": "qwen3-0.6b", "messages": [
        {"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]}),
    ("/v1/messages/render", {"model": "qwen3-0.6b", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": [None], "text": "hi"}]}]}),
    ("/v1/responses/render", {"model": "qwen3-0.6b", "input": [
        {"role": "user", "content": [{"type": {}, "text": "hi"}]}]}),
])
def test_odd_values_deep_in_a_body_are_400s(servers, path, body):
    """Values a deep mutation of valid bodies found answered with a 500 once, each now the API's 400."""
    r = servers[1].client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
