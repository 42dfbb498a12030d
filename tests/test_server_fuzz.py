"""Arbitrary JSON thrown at every POST endpoint: always a JSON answer, never a 5xx."""

from __future__ import annotations

import copy
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


# Valid bodies rich in nested shapes (content parts, reasoning, tool calls and results, tools, options), for each
# API; a deep mutation replaces values one to three levels inside them.
TOOL = {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
RICH = {
    "/v1/chat/completions/render": {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "find cats"}]},
        {"role": "assistant", "content": "ok", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"cats\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 cats"},
        {"role": "user", "content": "and dogs?"}],
        "tools": [TOOL], "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": True},
        "reasoning_effort": "low", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}}},
    "/v1/messages/render": {"max_tokens": 2000, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "find cats"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "cats"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "3"}]}]}],
        "tools": [{"name": "search", "description": "S", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    "/v1/responses/render": {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "find cats"}]},
        {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{\"q\":\"cats\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"role": "user", "content": "dogs?"}],
        "tools": [{"type": "function", "name": "search", "parameters": {"type": "object"}}],
        "tool_choice": "auto", "reasoning": {"effort": "low"}},
}
odd_values = st.sampled_from([None, True, 0, -1, 2**64, 1.5, "", "x", "<|im_start|>", [], {}, [None], [[]],
                              {"type": None}, {"type": "text"}, [{"type": "text"}], {"role": "user"}, ["low"]]) \
    | json_values


def _places(value, at=()):
    """Every place inside ``value`` (a path of keys and indices), the value itself first."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _places(inner, (*at, key))


@pytest.fixture(scope="module")
def rich_servers():
    from tests.harmony_fixtures import MODEL as GPT_OSS
    from tests.harmony_fixtures import gpt_oss_config

    with RenderServer(qwen3_config(True)) as qwen, RenderServer(gpt_oss_config()) as gpt_oss:
        yield {"qwen3-0.6b": qwen, GPT_OSS: gpt_oss}


@pytest.mark.parametrize("path", sorted(RICH))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deep_mutations_of_rich_bodies_never_get_a_5xx(rich_servers, path, data):
    """Odd values deep inside a valid body (a part's type, a call's arguments, an option's field), on a
    Qwen3 server with its parsers and on gpt-oss (Harmony): the API's 4xx, or a render."""
    model = data.draw(st.sampled_from(sorted(rich_servers)))
    body = json.loads(json.dumps({"model": model, **RICH[path]}))
    for _ in range(data.draw(st.integers(1, 3))):
        place = data.draw(st.sampled_from([p for p in _places(body) if p]))
        *parent, last = place
        target = body
        for key in parent:
            target = target[key]
        target[last] = copy.deepcopy(data.draw(odd_values))  # (sampled_from hands out its own objects)
    r = rich_servers[model].client.post(path, content=json.dumps(body).encode(),
                                        headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)


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
    # a json_schema response format whose json_schema is not an object
    ("/v1/chat/completions/render", {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "hi"}],
                                     "response_format": {"type": "json_schema", "json_schema": True}}),
])
def test_odd_values_deep_in_a_body_are_400s(servers, path, body):
    """Values a deep mutation of valid bodies found answered with a 500 once, each now the API's 400."""
    r = servers[1].client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
