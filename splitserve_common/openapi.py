"""The OpenAPI 3.1 builder for the three servers: documents generated from the msgspec structs at their wire boundary
(``msgspec.json.schema_components``), so the document cannot drift from what the servers decode and encode.

Each tier lists its own operations (its openapi module); the ops middleware
serves the document at /openapi.json; the fuzz tests hand it to schemathesis.
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
    error: Any = None  # the 4xx body type when it is not the document's (an API with its own error shape)


def ping_operations() -> list[Operation]:
    """SageMaker's health check, which vLLM serves on GET and POST: as /health."""
    return [Operation("/ping", method, "SageMaker's health check: as /health") for method in ("get", "post")]


def build_openapi(title: str, version: str, operations: list[Operation], error_type: type) -> dict[str, Any]:
    types: list[Any] = [error_type]
    for op in operations:
        types += list(op.request)
        types += list(op.response) if isinstance(op.response, tuple) else [op.response]
        types += [op.stream, op.error]
    types = [t for t in dict.fromkeys(types) if t is not None]
    by_type, components = _schemas(types)

    def schema_of(shapes: Any) -> dict[str, Any]:
        if isinstance(shapes, tuple):
            return by_type[shapes[0]] if len(shapes) == 1 else {"anyOf": [by_type[t] for t in shapes]}
        schema: dict[str, Any] = by_type[shapes]
        return schema
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
        own_error = {"description": "The API's own error shape",
                     "content": {"application/json": {"schema": by_type[op.error]}}} if op.error is not None else None
        responses: dict[str, Any] = {"200": ok, "4XX": own_error or error}
        if op.path in ("/health", "/ping") or op.method == "post":
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
        shared: dict[str, Any] = {}
        for t in types:
            try:
                (schema,), parts = msgspec.json.schema_components([t], ref_template=REF)
            except TypeError:
                schema, parts = {"type": "object"}, {}
            by_type[t] = schema
            shared.update(parts)
        return by_type, shared
