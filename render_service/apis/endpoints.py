"""The render tier's Responses and Messages endpoints: render (request -> GenerateRequest) and derender.

Handlers are the server's (auth, metrics, body limits), with errors in each API's own shape: OpenAI's envelope
for ``/v1/responses/*``, Anthropic's ``{"type": "error", "error": {...}}`` for ``/v1/messages/*``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.apis.errors import anthropic_error_body, openai_error_body
from render_service.errors import ApiError

if TYPE_CHECKING:
    from render_service.multimodal.endpoint import RenderWith
    from render_service.protocol import ChatCompletionRequest
    from render_service.render_config import RenderConfig

Handler = Callable[[Request], Awaitable[Response]]


def shaped(handler: Handler, body_of: Callable[[ApiError], bytes]) -> Handler:
    """Auth and errors in the API's own body (the server's ``endpoint`` still counts and logs)."""
    from render_service.server import JSON, check_auth

    async def run(request: Request) -> Response:
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


async def _render(request: Request, endpoint: str, kind: type, render: Callable[..., Any],
                  with_images: Callable[[Any, RenderConfig], tuple[ChatCompletionRequest, RenderWith]] | None = None
                  ) -> Response:
    """``with_images(req, config)``: the request as chat (image parts kept) and how to finish its render, for a
    body that may carry images (multimodal.endpoint)."""
    from render_service import metrics
    from render_service.multimodal.markers import may_carry_images
    from render_service.server import _state, decode, json_response, read_json_body

    state = _state(request)
    body = await read_json_body(request)
    req = decode(body, kind)
    request_id = request.headers.get("x-request-id")
    if with_images is not None and may_carry_images(body):
        from render_service.multimodal.endpoint import render_with_images

        chat, finish = with_images(req, state.config)
        gen = await render_with_images(body, chat, state.config, state.multimodal, state.render_queue, finish,
                                       endpoint)
        if gen is not None:
            metrics.PROMPT_TOKENS.inc(len(gen.token_ids))
            return json_response(gen, headers=state.render_headers)
    gen, _ = render(req, state.config, request_id=request_id)
    metrics.PROMPT_TOKENS.inc(len(gen.token_ids))
    return json_response(gen, headers=state.render_headers)


async def responses_render(request: Request) -> Response:
    from render_service.apis.responses import check_stateless, render_responses, to_chat
    from render_service.apis.responses_protocol import ResponsesRequest

    def with_images(req: ResponsesRequest, config: RenderConfig) -> tuple[ChatCompletionRequest, RenderWith]:
        check_stateless(req)
        request_id = request.headers.get("x-request-id")
        return to_chat(req, config), lambda chat, expand: render_responses(
            req, config, request_id=request_id, prepared=chat, expand_prompt=expand)[0]

    return await _render(request, "responses_render", ResponsesRequest, render_responses, with_images)


async def messages_render(request: Request) -> Response:
    from render_service.apis.messages import render_messages, to_chat
    from render_service.apis.messages_protocol import MessagesRequest

    def with_images(req: MessagesRequest, config: RenderConfig) -> tuple[ChatCompletionRequest, RenderWith]:
        chat, budget = to_chat(req, config)
        request_id = request.headers.get("x-request-id")
        return chat, lambda chat, expand: render_messages(
            req, config, request_id=request_id, prepared=(chat, budget), expand_prompt=expand)[0]

    return await _render(request, "messages_render", MessagesRequest, render_messages, with_images)


async def count_tokens(request: Request) -> Response:
    from render_service.apis.messages import count_tokens as count
    from render_service.apis.messages_protocol import CountTokensRequest, CountTokensResponse
    from render_service.server import _state, check_model, decode, json_response, read_json_body

    config = _state(request).config
    req = decode(await read_json_body(request), CountTokensRequest)
    check_model(req.model, config)
    return json_response(CountTokensResponse(input_tokens=count(req, config)))


async def _derender(request: Request, batch_type: type, batch: Callable[..., Any], stream_type: type,
                    stream: Callable[..., Any]) -> Response:
    from render_service.protocol import DerenderStreamProbe
    from render_service.server import _state, decode, json_response, read_json_body

    state = _state(request)
    body = await read_json_body(request)
    if decode(body, DerenderStreamProbe).stream:
        return json_response(stream(decode(body, stream_type), state.config, state.stream_runtime, request.headers))
    return json_response(batch(decode(body, batch_type), state.config, request.headers))


async def responses_derender(request: Request) -> Response:
    from render_service.apis import derender as d
    from render_service.apis import responses_protocol as p

    return await _derender(request, p.DerenderResponsesRequest, d.derender_responses, p.DerenderResponsesStreamRequest,
                           d.derender_responses_stream)


async def messages_derender(request: Request) -> Response:
    from render_service.apis import derender as d
    from render_service.apis import messages_protocol as p

    return await _derender(request, p.DerenderMessagesRequest, d.derender_messages, p.DerenderMessagesStreamRequest,
                           d.derender_messages_stream)


def api_routes(endpoint: Callable[..., Handler]) -> list[Route]:
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
