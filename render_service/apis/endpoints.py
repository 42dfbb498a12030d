"""The render tier's Responses and Messages endpoints: render (request -> GenerateRequest) and derender.

Handlers are the server's (auth, metrics, body limits), with errors in each API's own shape: OpenAI's envelope
for ``/v1/responses/*``, Anthropic's ``{"type": "error", "error": {...}}`` for ``/v1/messages/*``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.apis import derender as api_derender
from render_service.apis import messages_protocol, responses_protocol
from render_service.apis.errors import anthropic_error_body, openai_error_body
from render_service.apis.message_memo_anthropic import decode_messages_request
from render_service.apis.message_memo_responses import decode_responses_request
from render_service.apis.messages import count_chat, render_messages
from render_service.apis.messages import count_tokens as count_message_tokens
from render_service.apis.messages import to_chat as messages_to_chat
from render_service.apis.responses import check_stateless, render_responses
from render_service.apis.responses import to_chat as responses_to_chat
from render_service.http import metrics
from render_service.http.errors import ApiError
from render_service.http.request_io import (
    JSON,
    Answer,
    Handler,
    PiecesResponse,
    check_auth,
    client_of,
    decode,
    encode_json,
    endpoint,
    json_response,
    read_json_body,
    server_state,
)
from render_service.multimodal.endpoint import RenderWith, picture_chat, render_with_images
from render_service.multimodal.features import answer_pieces
from render_service.multimodal.markers import may_carry_images
from render_service.render.render_config import RenderConfig, check_model
from render_service.wire.protocol import ChatCompletionRequest, DerenderStreamProbe


def shaped(handler: Handler, body_of: Callable[[ApiError], bytes]) -> Handler:
    """Auth and errors in the API's own body (the server's ``endpoint`` still counts and logs)."""

    async def run(request: Request) -> Answer:
        try:
            check_auth(request)
            return await handler(request)
        except ApiError as exc:
            return Response(body_of(exc), status_code=exc.status, media_type=JSON, headers=exc.headers)

    return run


def openai_shaped(handler: Handler) -> Handler:
    return shaped(handler, openai_error_body)


def anthropic_shaped(handler: Handler) -> Handler:
    return shaped(handler, anthropic_error_body)


async def _render(request: Request, name: str, kind: type, render: Callable[..., Any],
                  with_images: Callable[[Any, RenderConfig], tuple[ChatCompletionRequest, RenderWith]] | None = None,
                  through_memo: Callable[[bytes, Any], Any] | None = None) -> Response:
    """``with_images(req, config)``: the request as chat (image parts kept) and how to finish its render, for a
    body that may carry images (multimodal.endpoint); ``through_memo(body, memo)``: the request decoded through
    the message memo, or None (then decoded the usual way)."""
    state = server_state(request)
    body = await read_json_body(request)
    request_id = request.headers.get("x-request-id")
    client = client_of(request)
    if with_images is not None and may_carry_images(body):
        chat, finish = with_images(decode(body, kind), state.config)
        pictured = await render_with_images(body, chat, state.config, state.multimodal, state.render_queue, finish,
                                            name)
        if pictured is not None:
            metrics.PROMPT_TOKENS.inc(len(pictured.token_ids))
            return PiecesResponse(answer_pieces(pictured, encode_json), state.render_headers)

    def job() -> Any:  # decoded and rendered on the render queue: large bodies off the event loop, as chat
        req = through_memo(body, state.config.message_memo) if through_memo is not None else None
        return render(req or decode(body, kind), state.config, request_id=request_id, client=client,
                      ids_view=True)[0]

    gen = await state.render_queue.run(name, len(body), job)
    metrics.PROMPT_TOKENS.inc(len(gen.token_ids))
    return json_response(gen, headers=state.render_headers)


async def responses_render(request: Request) -> Response:
    def with_images(req: responses_protocol.ResponsesRequest, config: RenderConfig
                    ) -> tuple[ChatCompletionRequest, RenderWith]:
        check_stateless(req)
        request_id = request.headers.get("x-request-id")
        return responses_to_chat(req, config), lambda chat, expand: render_responses(
            req, config, request_id=request_id, prepared=chat, expand_prompt=expand,
            client=client_of(request))[0]

    return await _render(request, "responses_render", responses_protocol.ResponsesRequest, render_responses,
                         with_images, decode_responses_request)


async def messages_render(request: Request) -> Response:
    def with_images(req: messages_protocol.MessagesRequest, config: RenderConfig
                    ) -> tuple[ChatCompletionRequest, RenderWith]:
        chat, budget = messages_to_chat(req, config)
        request_id = request.headers.get("x-request-id")
        return chat, lambda chat, expand: render_messages(
            req, config, request_id=request_id, prepared=(chat, budget), expand_prompt=expand,
            client=client_of(request))[0]

    return await _render(request, "messages_render", messages_protocol.MessagesRequest, render_messages, with_images,
                         decode_messages_request)


async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    config = state.config
    body = await read_json_body(request)
    if may_carry_images(body):  # images counted as the render expands them (multimodal.endpoint)
        def convert() -> tuple[messages_protocol.CountTokensRequest, ChatCompletionRequest]:
            req = decode(body, messages_protocol.CountTokensRequest)
            check_model(req.model, config)
            return req, count_chat(req, config)

        req, chat = await state.render_queue.run("count_tokens", len(body), convert)
        pictured = await picture_chat(chat, config, state.multimodal, lambda: False)  # a count needs no tensors
        if pictured is not None:
            counted = await state.render_queue.run("count_tokens", len(body), lambda: count_message_tokens(
                req, config, prepared=msgspec.structs.replace(chat, messages=pictured.messages),
                expand_prompt=pictured.expand))
            return json_response(messages_protocol.CountTokensResponse(input_tokens=counted))

    def job() -> int:
        req = decode(body, messages_protocol.CountTokensRequest)
        check_model(req.model, config)
        return count_message_tokens(req, config)

    tokens = await state.render_queue.run("count_tokens", len(body), job)
    return json_response(messages_protocol.CountTokensResponse(input_tokens=tokens))


async def _derender(request: Request, batch_type: type, batch: Callable[..., Any], stream_type: type,
                    stream: Callable[..., Any]) -> Response:
    state = server_state(request)
    body = await read_json_body(request)
    if decode(body, DerenderStreamProbe).stream:
        return json_response(stream(decode(body, stream_type), state.config, state.stream_runtime, request.headers))
    return json_response(batch(decode(body, batch_type), state.config, request.headers))


async def responses_derender(request: Request) -> Response:
    p = responses_protocol
    return await _derender(request, p.DerenderResponsesRequest, api_derender.derender_responses,
                           p.DerenderResponsesStreamRequest, api_derender.derender_responses_stream)


async def messages_derender(request: Request) -> Response:
    p = messages_protocol
    return await _derender(request, p.DerenderMessagesRequest, api_derender.derender_messages,
                           p.DerenderMessagesStreamRequest, api_derender.derender_messages_stream)


def api_routes() -> list[Route]:
    """The routes, each wrapped by the server's ``endpoint`` (auth is done in the API's error shape here)."""
    return [
        Route("/v1/responses/render", endpoint("responses_render", openai_shaped(responses_render), auth=False),
              methods=["POST"]),
        Route("/v1/responses/derender", endpoint("responses_derender", openai_shaped(responses_derender), auth=False),
              methods=["POST"]),
        Route("/v1/messages/render", endpoint("messages_render", anthropic_shaped(messages_render), auth=False),
              methods=["POST"]),
        Route("/v1/messages/derender", endpoint("messages_derender", anthropic_shaped(messages_derender), auth=False),
              methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint("messages_count_tokens", anthropic_shaped(count_tokens),
                                                    auth=False), methods=["POST"]),
    ]
