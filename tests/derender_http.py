"""Helpers for derender tests over HTTP: in-thread render servers per configuration, stream drivers, folds."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import httpx

from render_service.render.render_config import RenderConfig, build_render_config
from tests.render_harness import RenderServer, qwen3_bundle

MODEL = "qwen3-0.6b"
EOS = 151645
CHAT = "/v1/chat/completions/derender"
COMPLETIONS = "/v1/completions/derender"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@functools.cache
def config(**flags: Any) -> RenderConfig:
    """The Qwen3 fixture bundle (loaded once) under these server flags."""
    return build_render_config(qwen3_bundle(), served_model_names=[MODEL], **flags)


@contextlib.contextmanager
def server(**flags: Any) -> Iterator[httpx.Client]:
    with RenderServer(config(**flags)) as srv:
        yield srv.client


def encode(text: str) -> list[int]:
    return qwen3_bundle().tokenizer.encode(text)


def chat_request(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}


def post_ok(client: httpx.Client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def batch_chat(client: httpx.Client, ids: list[int], chat_req: dict | None, request_id: str = "gen-1",
               finish_reason: str = "stop", logprobs: Any = None, n_choices: int = 1) -> dict:
    body: dict[str, Any] = {"model": MODEL, "generate_response": {"request_id": request_id, "choices": [
        {"index": i, "token_ids": ids, "finish_reason": finish_reason, "logprobs": logprobs}
        for i in range(n_choices)]}, "prompt_tokens": 11}
    if chat_req is not None:
        body["chat_request"] = chat_req
    return post_ok(client, CHAT, body)


def stream_chat(client: httpx.Client, chunks: list[list[int]], chat_req: dict | None, request_id: str = "gen-1",
                finish_reason: str = "stop", logprobs_for: Any = None, index: int = 0) -> list[dict]:
    """One call per chunk, echoing stream_state; the last chunk carries the finish. Returns the chunks."""
    state, out = None, []
    for k, ids in enumerate(chunks):
        choice: dict[str, Any] = {"index": index, "token_ids": ids,
                                  "finish_reason": finish_reason if k == len(chunks) - 1 else None}
        if logprobs_for is not None:
            choice["logprobs"] = logprobs_for(ids)
        body: dict[str, Any] = {"stream": True, "model": MODEL, "stream_state": state, "prompt_tokens": 11,
                                "generate_chunk": {"request_id": request_id, "choices": [choice]}}
        if chat_req is not None:
            body["chat_request"] = chat_req
        answer = post_ok(client, CHAT, body)
        state = answer["stream_state"]
        out.append(answer["chunk"])
    return out


def fold_chat_chunks(chunks: list[dict], field: str = "reasoning") -> dict:
    """What an OpenAI client rebuilds from chat chunks (one choice)."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            reasoning.append(delta.get(field) or "")
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                fn = tc.get("function") or {}
                call["name"] = fn.get("name") or call["name"]
                call["arguments"] += fn.get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def batch_as_fold(choice: dict, field: str = "reasoning") -> dict:
    """A batch choice in fold_chat_chunks' shape ("" content counts as none, as a fold cannot tell)."""
    msg = choice["message"]
    return {"content": msg["content"] or None, "reasoning": msg.get(field),
            "tool_calls": [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                           for c in msg.get("tool_calls") or []],
            "finish_reason": choice["finish_reason"]}


def one_token_chunks(ids: list[int]) -> list[list[int]]:
    return [[t] for t in ids]
