"""The render tier's and the gateway's OpenAPI operations, from the msgspec structs at their wire boundary."""

from __future__ import annotations

from typing import Any

from splitserve_common.openapi import Operation, build_openapi, ping_operations


def render_operations() -> list[Operation]:
    from render_service.wire import protocol as p

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
        *api_operations(),
        Operation("/tokenize", "post", "Tokenize a prompt or a conversation", (p.TokenizeRequest,), p.TokenizeResponse),
        Operation("/detokenize", "post", "Token IDs to text", (p.DetokenizeRequest,), p.DetokenizeResponse),
        Operation("/v1/models", "get", "Served model names", response=p.ModelList),
        Operation("/health", "get", "Readiness: 200 when serving, 503 while draining"),
        *ping_operations(),
        Operation("/version", "get", "Version and render fingerprint", response=dict[str, str]),
        Operation("/metrics", "get", "Prometheus metrics", text=True),
        Operation("/load", "get", "Renders running and queued (vLLM's server_load)", response=dict[str, int]),
    ]


def api_operations() -> list[Operation]:
    """Responses and Messages render/derender (render_service/apis/)."""
    from render_service.apis import messages_protocol as m
    from render_service.apis import responses_protocol as r
    from render_service.apis.errors import AnthropicErrorBody, OpenAIErrorBody
    from render_service.wire import protocol as p

    return [
        Operation("/v1/responses/render", "post", "Responses request to engine-ready token IDs",
                  (r.ResponsesRequest,), p.GenerateRequest, error=OpenAIErrorBody),
        Operation("/v1/responses/derender", "post", "Engine output to a Responses response (batch or one chunk)",
                  (r.DerenderResponsesRequest, r.DerenderResponsesStreamRequest),
                  (r.ResponseObject, r.DerenderResponsesStreamResponse), error=OpenAIErrorBody),
        Operation("/v1/messages/render", "post", "Anthropic Messages request to engine-ready token IDs",
                  (m.MessagesRequest,), p.GenerateRequest, error=AnthropicErrorBody),
        Operation("/v1/messages/derender", "post", "Engine output to an Anthropic message (batch or one chunk)",
                  (m.DerenderMessagesRequest, m.DerenderMessagesStreamRequest),
                  (m.MessageObject, m.DerenderMessagesStreamResponse), error=AnthropicErrorBody),
        Operation("/v1/messages/count_tokens", "post", "Prompt token count of a Messages request",
                  (m.CountTokensRequest,), m.CountTokensResponse, error=AnthropicErrorBody),
    ]


def gateway_operations() -> list[Operation]:
    from render_service.wire import protocol as p

    return render_operations() + [
        Operation("/v1/chat/completions", "post", "OpenAI chat completions over the engine pools",
                  (p.ChatCompletionRequest,), p.ChatCompletionResponse, stream=p.ChatCompletionStreamResponse),
        Operation("/v1/completions", "post", "OpenAI completions over the engine pools",
                  (p.CompletionRequest,), p.CompletionResponse, stream=p.CompletionStreamResponse),
        Operation("/invocations", "post", "SageMaker's inference path: a chat body (messages) or a completion (prompt)",
                  (p.ChatCompletionRequest, p.CompletionRequest), (p.ChatCompletionResponse, p.CompletionResponse)),
        Operation("/gateway/status", "get", "Engine pools, replicas and counters", response=dict[str, Any]),
    ]


def render_openapi(version: str, gateway: bool) -> dict[str, Any]:
    from render_service.wire.protocol import ErrorResponse

    if gateway:
        return build_openapi("splitserve gateway", version, gateway_operations(), ErrorResponse)
    return build_openapi("splitserve render service", version, render_operations(), ErrorResponse)
