"""The configuration fingerprint: stamped on render output, checked by derender."""

from __future__ import annotations

import dataclasses

import pytest

from render_service.render.fingerprint import config_fingerprint
from tests.render_harness import RenderServer, qwen3_config

CHAT = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "Hi"}]}
GEN = {"request_id": "g-1", "choices": [{"index": 0, "token_ids": [9707, 0, 151645], "finish_reason": "stop"}]}

BASE = dict(tokenizer_sha256="a" * 64, chat_template="{{ messages }}", reasoning_parser=None, tool_call_parser=None,
            enable_auto_tool_choice=False, default_chat_template_kwargs={})


@pytest.fixture(scope="module")
def server():
    with RenderServer(qwen3_config(False)) as srv:
        yield srv


def test_fingerprint_changes_with_every_input():
    base = config_fingerprint(**BASE)
    assert base == config_fingerprint(**BASE)
    assert base.startswith("fp1-") and len(base) == 20
    for key, value in (("tokenizer_sha256", "b" * 64), ("chat_template", "{{ messages|length }}"),
                       ("reasoning_parser", "qwen3"), ("tool_call_parser", "hermes"),
                       ("enable_auto_tool_choice", True), ("default_chat_template_kwargs", {"enable_thinking": False})):
        assert config_fingerprint(**{**BASE, key: value}) != base, key


def test_fingerprint_ignores_kwargs_order():
    a = config_fingerprint(**{**BASE, "default_chat_template_kwargs": {"x": 1, "y": 2}})
    b = config_fingerprint(**{**BASE, "default_chat_template_kwargs": {"y": 2, "x": 1}})
    assert a == b


def test_parser_flags_change_the_served_fingerprint():
    assert qwen3_config(False).fingerprint != qwen3_config(True).fingerprint


def test_render_output_carries_the_fingerprint_in_body_and_header(server):
    r = server.client.post("/v1/chat/completions/render", json=CHAT)
    assert r.json()["render_fingerprint"] == qwen3_config(False).fingerprint
    assert r.headers["x-render-fingerprint"] == qwen3_config(False).fingerprint
    r = server.client.post("/v1/completions/render", json={"prompt": ["a", "b"]})
    assert {g["render_fingerprint"] for g in r.json()} == {qwen3_config(False).fingerprint}


def test_derender_accepts_a_matching_or_absent_fingerprint(server):
    fp = qwen3_config(False).fingerprint
    for body, headers in (({}, {}), ({"render_fingerprint": fp}, {}), ({}, {"x-render-fingerprint": fp})):
        r = server.client.post("/v1/chat/completions/derender", json={"generate_response": GEN, **body}, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "Hello!"


@pytest.mark.parametrize("where", ["body", "header", "generate_response"])
def test_derender_refuses_a_mismatching_fingerprint(server, where):
    body = {"generate_response": dict(GEN)}
    headers = {}
    if where == "body":
        body["render_fingerprint"] = "fp1-0000000000000000"
    elif where == "header":
        headers["x-render-fingerprint"] = "fp1-0000000000000000"
    else:
        body["generate_response"]["render_fingerprint"] = "fp1-0000000000000000"
    for path, payload in (("/v1/chat/completions/derender", body),
                          ("/v1/completions/derender", {"generate_responses": [body["generate_response"]],
                                                        **{k: v for k, v in body.items() if k != "generate_response"}})):
        r = server.client.post(path, json=payload, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "render fingerprint mismatch" in error["message"]
        assert error["param"] == "render_fingerprint"


def test_a_render_tier_with_another_template_refuses_our_output():
    other = dataclasses.replace(qwen3_config(False), fingerprint=config_fingerprint(**BASE))
    with RenderServer(qwen3_config(False)) as ours, RenderServer(other) as theirs:
        rendered = ours.client.post("/v1/chat/completions/render", json=CHAT).json()
        body = {"generate_response": GEN, "render_fingerprint": rendered["render_fingerprint"]}
        assert ours.client.post("/v1/chat/completions/derender", json=body).status_code == 200
        assert theirs.client.post("/v1/chat/completions/derender", json=body).status_code == 400
