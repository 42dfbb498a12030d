"""OpenAPI 3.1 documents for the three servers, generated from the msgspec structs at their wire boundary
(``msgspec.json.schema_components``), so the document cannot drift from what the servers decode and encode.

The ops middleware serves the document at /openapi.json; the fuzz tests hand it to schemathesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    summary: str
    request: tuple[type, ...] = ()  # one struct, or several accepted shapes (anyOf)
    response: Any = None  # the 200 JSON body type (a tuple: one of several); None: no JSON body
    stream: Any = None  # the type of each SSE event when the request asks for a stream
    text: bool = False  # 200 body is text (metrics)


def render_operations() -> list[Operation]:
    from render_service import protocol as p

    return [
        Operation("/v1/chat/completions/render", "post", "Chat request to engine-ready token IDs",
                  (p.ChatCompletionRequest,), p.GenerateRequest),
        Operation("/v1/completions/render", "post", "Completion request to engine-ready token IDs",
                  (p.CompletionRequest,), list[p.GenerateRequest]),
        Operation("/v1/chat/completions/derender", "post", "Engine output to a chat completion (batch or one chunk)",
                  (p.DerenderChatRequest, p.DerenderChatStreamRequest),
                  (p.ChatCompletionResponse, p.DerenderChatStreamResponse)),
        Operation("/v1/completions/derender", "post", "Engine output to a completion (batch or one chunk)",
                  (p.DerenderCompletionRequest, p.DerenderCompletionStreamRequest),
                  (p.CompletionResponse, p.DerenderCompletionStreamResponse)),
        Operation("/tokenize", "post", "Tokenize a prompt or a conversation", (p.TokenizeRequest,), p.TokenizeResponse),
        Operation("/detokenize", "post", "Token IDs to text", (p.DetokenizeRequest,), p.DetokenizeResponse),
        Operation("/v1/models", "get", "Served model names", response=p.ModelList),
        Operation("/health", "get", "Readiness: 200 when serving, 503 while draining"),
        Operation("/version", "get", "Version and render fingerprint", response=dict[str, str]),
        Operation("/metrics", "get", "Prometheus metrics", text=True),
    ]


def gateway_operations() -> list[Operation]:
    from render_service import protocol as p

    return render_operations() + [
        Operation("/v1/chat/completions", "post", "OpenAI chat completions over the engine pools",
                  (p.ChatCompletionRequest,), p.ChatCompletionResponse, stream=p.ChatCompletionStreamResponse),
        Operation("/v1/completions", "post", "OpenAI completions over the engine pools",
                  (p.CompletionRequest,), p.CompletionResponse, stream=p.CompletionStreamResponse),
        Operation("/gateway/status", "get", "Engine pools, replicas and counters", response=dict[str, Any]),
    ]


def engine_operations() -> list[Operation]:
    from token_engine import protocol as p

    return [
        Operation("/inference/v1/generate", "post", "Token IDs in, token IDs out (vLLM tokens-only API)",
                  (p.GenerateRequest,), p.GenerateResponse, stream=p.GenerateStreamResponse),
        Operation("/inference/v1/abort_requests", "post", "Abort requests by id", (p.AbortRequest,)),
        Operation("/health", "get", "Readiness: 200 when serving, 503 while draining or when the engine died"),
        Operation("/v1/models", "get", "The served model", response=dict[str, Any]),
        Operation("/version", "get", "Version", response=dict[str, str]),
        Operation("/metrics", "get", "Prometheus metrics (vLLM names)", text=True),
        Operation("/debug/kv_cache", "get", "KV block accounting", response=dict[str, int]),
    ]


def build_openapi(title: str, version: str, operations: list[Operation], error_type: type) -> dict[str, Any]:
    types: list[Any] = [error_type]
    for op in operations:
        types += list(op.request)
        types += list(op.response) if isinstance(op.response, tuple) else [op.response]
        types += [op.stream]
    types = [t for t in dict.fromkeys(types) if t is not None]
    by_type, components = _schemas(types)

    def schema_of(shapes: Any) -> dict[str, Any]:
        if isinstance(shapes, tuple):
            return by_type[shapes[0]] if len(shapes) == 1 else {"anyOf": [by_type[t] for t in shapes]}
        return by_type[shapes]
    error = {"description": "OpenAI-style error", "content": {"application/json": {"schema": by_type[error_type]}}}
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        ok: dict[str, Any] = {"description": "OK"}
        content: dict[str, Any] = {}
        if op.response is not None:
            content["application/json"] = {"schema": schema_of(op.response)}
        if op.stream is not None:
            # Server-sent events: "data: <event JSON>" lines, then "data: [DONE]".
            content["text/event-stream"] = {"schema": {"type": "string"},
                                            "x-event-schema": by_type[op.stream]}
        if op.text:
            content["text/plain"] = {"schema": {"type": "string"}}
        if content:
            ok["content"] = content
        responses: dict[str, Any] = {"200": ok, "4XX": error}
        if op.path == "/health" or op.method == "post":
            responses["503"] = {"description": "Draining or unavailable", **(
                {"content": error["content"]} if op.method == "post" else {})}
        entry: dict[str, Any] = {"summary": op.summary, "operationId": op.method + op.path.replace("/", "_"),
                                 "responses": responses}
        if op.request:
            entry["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema_of(op.request)}}}
        paths.setdefault(op.path, {})[op.method] = entry
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


def _schemas(types: list[Any]) -> tuple[dict[Any, Any], dict[str, Any]]:
    """(schema per type, shared components). A type msgspec cannot describe (an encode-only union of
    untagged structs, as the engine's logprobs) is documented as a plain object instead."""
    try:
        schemas, components = msgspec.json.schema_components(types, ref_template=REF)
        return dict(zip(types, schemas)), components
    except TypeError:
        by_type: dict[Any, Any] = {}
        components: dict[str, Any] = {}
        for t in types:
            try:
                (schema,), parts = msgspec.json.schema_components([t], ref_template=REF)
            except TypeError:
                schema, parts = {"type": "object"}, {}
            by_type[t] = schema
            components.update(parts)
        return by_type, components


def render_openapi(version: str, gateway: bool) -> dict[str, Any]:
    from render_service.protocol import ErrorResponse

    if gateway:
        return build_openapi("splitserve gateway", version, gateway_operations(), ErrorResponse)
    return build_openapi("splitserve render service", version, render_operations(), ErrorResponse)


def engine_openapi(version: str) -> dict[str, Any]:
    from token_engine.protocol import ErrorResponse

    return build_openapi("splitserve token engine", version, engine_operations(), ErrorResponse)
