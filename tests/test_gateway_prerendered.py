"""Requests that carry their rendered token ids are not rendered again: vLLM's
``kv_transfer_params.prompt_token_ids``, and our render tier's GenerateRequest checked by its fingerprint.
A real engine process and a real gateway process (tests/gateway_harness.py's scripted tiny Qwen3)."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_harness import (
    PLAIN_PROMPT_END,
    PLAIN_SCRIPT,
    PLAIN_TEXT,
    engine_process,
    gateway_process,
    write_scripted_qwen3,
)
from tests.render_harness import RenderServer, qwen3_config

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = write_scripted_qwen3(tmp_path_factory.mktemp("prerendered") / "tiny")
    engine = engine_process(model)
    gw = gateway_process(model, ["--engine", engine.url])
    try:
        with httpx.Client(base_url=gw.url, timeout=120) as client:
            yield client
    finally:
        gw.stop()
        engine.stop()


def chat(messages, **extra) -> dict:
    return {"model": "tiny", "messages": messages, "temperature": 0, **NO_THINKING, **extra}


def render(client: httpx.Client, messages) -> dict:
    r = client.post("/v1/chat/completions/render", json=chat(messages))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_router_that_rendered_once_gets_the_same_answer(gateway):
    gen = render(gateway, USER)  # the router's render, for prefix-aware routing
    kv = {"prompt_token_ids": gen["token_ids"], "render_fingerprint": gen["render_fingerprint"]}
    r = gateway.post("/v1/chat/completions", json=chat(USER, kv_transfer_params=kv, return_token_ids=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == PLAIN_TEXT
    assert body["choices"][0]["token_ids"] == PLAIN_SCRIPT
    assert body["prompt_token_ids"] == gen["token_ids"]


def test_the_ids_given_are_used_not_a_new_render_of_the_messages(gateway):
    other_ids = render(gateway, OTHER)["token_ids"]
    assert other_ids != render(gateway, USER)["token_ids"] and other_ids[-1] == PLAIN_PROMPT_END
    for kv, headers in (({"prompt_token_ids": other_ids}, {}),  # vLLM's shape: no fingerprint
                        ({"prompt_token_ids": other_ids}, {"x-render-fingerprint": render(gateway, OTHER)
                                                           ["render_fingerprint"]})):
        r = gateway.post("/v1/chat/completions", json=chat(USER, kv_transfer_params=kv, return_token_ids=True),
                         headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == other_ids
        assert r.json()["usage"]["prompt_tokens"] == len(other_ids)


def test_streamed_requests_use_the_given_ids_too(gateway):
    ids = render(gateway, OTHER)["token_ids"]
    with gateway.stream("POST", "/v1/chat/completions",
                        json=chat(USER, stream=True, kv_transfer_params={"prompt_token_ids": ids},
                                  return_token_ids=True)) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    assert f'"prompt_token_ids":{ids}'.replace(" ", "") in first.replace(" ", "")


@pytest.mark.parametrize("kv, headers, param", [
    ({"prompt_token_ids": [1, 2, 3], "render_fingerprint": "fp1-0000000000000000"}, {},
     "kv_transfer_params.render_fingerprint"),
    ({"prompt_token_ids": [1, 2, 3]}, {"x-render-fingerprint": "fp1-ffffffffffffffff"},
     "kv_transfer_params.render_fingerprint"),
    ({"prompt_token_ids": [1, 10**9]}, {}, "kv_transfer_params.prompt_token_ids"),
    ({"prompt_token_ids": []}, {}, "kv_transfer_params.prompt_token_ids"),
    ({"prompt_token_ids": [1, "2"]}, {}, "kv_transfer_params.prompt_token_ids"),
    ({"prompt_token_ids": [1, 2], "do_remote_decode": True}, {}, "kv_transfer_params"),
])
def test_bad_prerendered_ids_are_400(gateway, kv, headers, param):
    r = gateway.post("/v1/chat/completions", json=chat(USER, kv_transfer_params=kv), headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_gateway_extends_a_prompt_the_render_endpoint_keeps(gateway):
    made = gateway.post("/v1/chat/completions/render", json=chat(USER, return_prompt_ref=True)).json()
    first = gateway.post("/v1/chat/completions", json=chat(USER, return_token_ids=True)).json()
    sampled = first["choices"][0]["token_ids"]
    messages = [*USER, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And in Rome?"}]
    turn = {"prompt_ref": made["prompt_ref"], "completion_token_ids": sampled}
    r = gateway.post("/v1/chat/completions", json=chat(messages, previous_turn=turn, return_token_ids=True))
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"][:len(made["token_ids"]) + len(sampled)] == made["token_ids"] + sampled
    # the same turn sending only its new messages (the earlier ones kept with the reference) runs the same prompt
    new = gateway.post("/v1/chat/completions", json=chat(messages[len(USER):], return_token_ids=True,
                                                         previous_turn={**turn, "messages": "new"}))
    assert new.status_code == 200, new.text
    assert new.json()["prompt_token_ids"] == r.json()["prompt_token_ids"]
    # The gateway's answer has no place for a reference: asking for one is refused, not ignored.
    r = gateway.post("/v1/chat/completions", json=chat(USER, return_prompt_ref=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_prompt_ref"
    r = gateway.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER,
                                           "return_prompt_ref": True})
    assert r.status_code == 400 and "return_prompt_ref" in r.text
    # nor an answer of the appended ids alone: the gateway runs the whole prompt
    r = gateway.post("/v1/chat/completions", json=chat(messages, previous_turn={**turn, "answer": "appended"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_turn.answer"


def test_the_render_endpoint_takes_the_ids_and_keeps_them_from_the_engine():
    with RenderServer(qwen3_config()) as srv:
        ids = srv.client.post("/v1/chat/completions/render", json=chat(OTHER, model="qwen3-0.6b")).json()["token_ids"]
        r = srv.client.post("/v1/chat/completions/render", json=chat(
            USER, model="qwen3-0.6b", kv_transfer_params={"prompt_token_ids": ids, "do_remote_decode": True}))
        assert r.status_code == 200, r.text
        gen = r.json()
        assert gen["token_ids"] == ids
        # what goes on to the engine, at the top level (vLLM 0.33's shape): the render keys are gone
        assert gen["kv_transfer_params"] == {"do_remote_decode": True} and "extra_args" not in gen["sampling_params"]
