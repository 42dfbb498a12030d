"""The engine's OpenAPI operations, from the msgspec structs at its wire boundary."""

from __future__ import annotations

from typing import Any

from splitserve_common.openapi import Operation, build_openapi, ping_operations


def engine_operations() -> list[Operation]:
    from token_engine.http import protocol as p

    return [
        Operation("/inference/v1/generate", "post",
                  "Token IDs in; token IDs, text or parsed messages out (vLLM's generate API, output_mode)",
                  (p.GenerateRequest,), (p.GenerateResponse, p.GenerateDerenderResponse),
                  stream=p.GenerateStreamResponse),
        Operation("/inference/v1/abort_requests", "post", "Abort requests by id", (p.AbortRequest,)),
        Operation("/health", "get", "Readiness: 200 when serving, 503 while draining or when the engine died"),
        *ping_operations(),
        Operation("/load", "get", "Generate requests in flight (vLLM's server_load)", response=dict[str, int]),
        Operation("/v1/models", "get", "The served model", response=dict[str, Any]),
        Operation("/version", "get", "Version", response=dict[str, str]),
        Operation("/metrics", "get", "Prometheus metrics (vLLM names)", text=True),
        Operation("/debug/kv_cache", "get", "KV block accounting", response=dict[str, int]),
    ]


def engine_openapi(version: str) -> dict[str, Any]:
    from token_engine.http.protocol import ErrorResponse

    return build_openapi("splitserve token engine", version, engine_operations(), ErrorResponse)
