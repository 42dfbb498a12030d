"""The disaggregated flows across implementations: our render tier or vLLM 0.32's (render and derender) over our
engine or vLLM 0.32's CPU engine, on one tiny random Qwen3 (the real Qwen3 tokenizer, head_dim 32 for vLLM's CPU
attention). Every combination serves the 3-hop batch flow (render -> generate -> derender) and the streaming one
(one derender call per engine event, ``stream_state`` echoed), and all four answer the same greedy text: the
render tiers give the same token ids and the engines the same greedy tokens on the same weights. vLLM's render
tier also drives our 4-hop P/D flow (render, prefill, decode over NIXL, derender). Slow; skips without the peers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway_harness import engine_process
from tests.render_harness import RenderServer, qwen3_config
from tests.vllm_peers import MODEL, needs_vllm032

pytestmark = [needs_vllm032, pytest.mark.slow]

REQUEST = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0,
           "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def ours(vllm032_engine):
    engines = [engine_process(vllm032_engine.model, max_model_len=512, kv_engine_id=f"fleet-{i}", wait=False)
               for i in range(2)]
    for e in engines:
        e.wait_healthy()
    with RenderServer(qwen3_config(True)) as render:
        yield {"render": render, "engine": engines[0], "prefill": engines[0], "decode": engines[1]}
    for e in engines:
        e.stop()


def post(url: str, path: str, body: dict) -> dict | list:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, (url, path, r.text)
    return r.json()


def engine_body(gen: dict, **changes) -> dict:
    # the engines serve the weights as "tiny", the render tiers as "qwen3-0.6b": a router drops the name
    return {**gen, "model": None, **changes}


def batch_flow(render_url: str, engine_url: str) -> tuple[list[int], str]:
    gen = post(render_url, "/v1/chat/completions/render", REQUEST)
    out = post(engine_url, "/inference/v1/generate", engine_body(gen))
    answer = post(render_url, "/v1/chat/completions/derender", {
        "model": MODEL, "generate_response": out, "chat_request": REQUEST, "prompt_token_ids": gen["token_ids"],
        "prompt_tokens": len(gen["token_ids"])})
    message = answer["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"])
    return gen["token_ids"], message["content"] or ""


def stream_flow(render_url: str, engine_url: str) -> str:
    gen = post(render_url, "/v1/chat/completions/render", {**REQUEST, "stream": True})
    state, text = None, []
    body = engine_body(gen, stream=True)
    with httpx.stream("POST", engine_url + "/inference/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            answer = post(render_url, "/v1/chat/completions/derender", {
                "model": MODEL, "stream": True, "generate_chunk": json.loads(line[6:]), "stream_state": state,
                "chat_request": REQUEST, "prompt_token_ids": gen["token_ids"]})
            state = answer["stream_state"] if answer["chunk"]["choices"] else state
            for choice in answer["chunk"]["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_every_render_and_engine_combination_serves_the_same_greedy_answer(vllm032_render, vllm032_engine, ours):
    renders = {"ours": ours["render"].url, "vllm": vllm032_render.url}
    engines = {"ours": ours["engine"].url, "vllm": vllm032_engine.url}
    answers = {}
    for r_name, r_url in renders.items():
        for e_name, e_url in engines.items():
            prompt, text = batch_flow(r_url, e_url)
            assert stream_flow(r_url, e_url) == text, (r_name, e_name)  # the stream folds to the batch answer
            answers[(r_name, e_name)] = (tuple(prompt), text)
    assert len(set(answers.values())) == 1, answers
    assert next(iter(answers.values()))[1]  # and it said something


def test_vllms_render_tier_drives_our_prefill_decode_pair(vllm032_render, ours):
    url = vllm032_render.url
    gen = post(url, "/v1/chat/completions/render", REQUEST)
    prefill = post(ours["prefill"].url, "/inference/v1/generate", engine_body(
        gen, sampling_params={**gen["sampling_params"], "max_tokens": 1},
        kv_transfer_params={"do_remote_decode": True}))
    kv = prefill["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True
    decoded = post(ours["decode"].url, "/inference/v1/generate", engine_body(
        gen, kv_transfer_params={**kv, "prompt_token_ids": gen["token_ids"]}))
    answer = post(url, "/v1/chat/completions/derender", {
        "model": MODEL, "generate_response": decoded, "chat_request": REQUEST, "prompt_token_ids": gen["token_ids"]})
    assert answer["choices"][0]["message"]["content"] == batch_flow(url, ours["engine"].url)[1]
