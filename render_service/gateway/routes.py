"""/v1/chat/completions and /v1/completions: render -> engine(s) -> derender in one call.

Render and derender are the functions the /render and /derender endpoints call, run in-process; only
the engine hops are HTTP. A streaming response starts once every engine stream's first events are in, so
that anything that fails before them (a 4xx from an engine, no replica left) is still an HTTP error with
its status; after that, a failure is an error event followed by [DONE]. A client that goes away aborts
its engine requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.extend.protocol import PreviousTurn
from render_service.gateway import metrics
from render_service.gateway.conversations import conversation_key
from render_service.gateway.engine_client import EngineRejected, EngineStreamBroken
from render_service.gateway.flow import EngineCall, EngineStream, Gateway, NoReplica, fanout_violation, plan_streams
from render_service.gateway.images import picture, prepared, with_features
from render_service.gateway.merged import MergedStreams, SpanDone, open_merged
from render_service.gateway.responses import ChatResponder, CompletionResponder
from render_service.gateway.sse_relay import SseRelay
from render_service.gateway.tenancy import request_tenant
from render_service.http.errors import ApiError, bad_request, error_body
from render_service.http.render_queue import RenderQueue
from render_service.http.request_io import Answer, client_of, decode, endpoint, read_json_body
from render_service.render.fingerprint import FINGERPRINT_HEADER
from render_service.render.prerendered import RENDER_KEYS
from render_service.render.render import render_chat, render_completion
from render_service.render.render_config import RenderConfig
from render_service.wire.message_memo import carries_image_parts, decode_chat_request
from render_service.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateStreamChoice,
)

logger = logging.getLogger("render_service.gateway.routes")

_encode = msgspec.json.Encoder().encode


def gateway_routes(gateway: Gateway, config: RenderConfig, render_queue: RenderQueue | None = None) -> list[Route]:
    """The routes, wrapped by the server's ``endpoint`` (auth, error envelope, metrics). Renders go through the
    server's ``render_queue`` (large bodies off the event loop, admission and saturation metrics). The
    Responses and Messages routes are gateway/api_routes.py's."""
    queue = render_queue or RenderQueue()

    async def chat(request: Request, body: bytes | None = None) -> Answer:
        body = await read_json_body(request) if body is None else body
        request_id = request.headers.get("x-request-id")
        fingerprint = request.headers.get(FINGERPRINT_HEADER)
        client = client_of(request)  # (previous_turn.prompt_ref: a reference the render endpoint made for it)

        def render_text(req: ChatCompletionRequest) -> GenerateRequest:
            return render_chat(req, config, request_id=request_id, render_fingerprint=fingerprint, client=client)

        def render() -> tuple[ChatCompletionRequest, GenerateRequest | None]:
            req = decode_chat_request(body, config.message_memo, decode)
            _check_supported(req)
            # Images are found in the decoded messages (the memo decodes only a conversation's new ones), not by
            # a scan of the whole body; the image path takes such a request as decoded here.
            return req, None if carries_image_parts(req.messages) else render_text(req)

        req, gen = await queue.run("chat_completions", len(body), render)
        if gen is None:  # the render endpoints' image path
            answer = await chat_with_images(request, body, req, request_id, fingerprint)
            if answer is not None:
                return answer
            gen = await queue.run("chat_completions", len(body), lambda: render_text(req))
        conversation = conversation_key(req.conversation_id, request.headers)
        responder = ChatResponder(gen, req, config)
        return await respond(request, gateway, [gen], responder, bool(req.stream), conversation)

    async def chat_with_images(request: Request, body: bytes, req: ChatCompletionRequest, request_id: str | None,
                               fingerprint: str | None) -> Answer | None:
        """A chat request with image parts (None: it has none after all): its images processed, then rendered
        and driven like any chat request, the engine getting the expanded ids and ``features``."""
        pictured = await picture(request, body, req, config)
        if pictured is None:
            return None

        def render() -> GenerateRequest:
            gen = render_chat(prepared(req, pictured), config, request_id=request_id, render_fingerprint=fingerprint,
                              expand_prompt=pictured.expand)
            return with_features(gen, pictured)

        gen = await queue.run("chat_completions", len(body), render)
        conversation = conversation_key(req.conversation_id, request.headers)
        return await respond(request, gateway, [gen], ChatResponder(gen, req, config), bool(req.stream), conversation)

    async def completions(request: Request, body: bytes | None = None) -> Answer:
        body = await read_json_body(request) if body is None else body
        request_id = request.headers.get("x-request-id")

        def render() -> tuple[CompletionRequest, list[GenerateRequest]]:
            req = decode(body, CompletionRequest)
            _check_supported(req)
            if req.kv_transfer_params is not None:
                raise bad_request("kv_transfer_params are set by the gateway, not by clients", "kv_transfer_params")
            return req, render_completion(req, config, request_id=request_id)

        req, gens = await queue.run("completions", len(body), render)
        first_id = gens[0].request_id or ""  # render names every request
        response_id = first_id if len(gens) == 1 else first_id.rsplit("-", 1)[0]
        responder = CompletionResponder(gens, req, config, response_id)
        conversation = conversation_key(req.conversation_id, request.headers)
        return await respond(request, gateway, gens, responder, bool(req.stream), conversation)

    async def invocations(request: Request) -> Answer:
        """SageMaker's one inference path, as vLLM's: a chat request if the body has ``messages``, else a
        completion request if it has ``prompt`` (vLLM tries ChatCompletionRequest, then CompletionRequest)."""
        body = await read_json_body(request)
        shape = decode(body, InvocationShape)
        if shape.has("messages"):
            return await chat(request, body)
        if shape.has("prompt"):
            return await completions(request, body)
        raise bad_request("Cannot find suitable handler for request. Expected one of: "
                          "['ChatCompletionRequest', 'CompletionRequest']")

    async def status(request: Request) -> Response:
        return Response(_encode(gateway.snapshot()), media_type="application/json")

    return [
        Route("/v1/chat/completions", endpoint("chat_completions", chat), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
        Route("/invocations", endpoint("invocations", invocations), methods=["POST"]),
        Route("/gateway/status", endpoint("gateway_status", status), methods=["GET"]),
    ]


class InvocationShape(msgspec.Struct):
    """Just enough of an /invocations body to pick its endpoint (the rest is decoded there)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()

    def has(self, key: str) -> bool:
        raw = memoryview(getattr(self, key))
        return len(raw) > 0 and (len(raw) != 4 or raw.tobytes() != b"null")


class _RenderOnlyFields(Protocol):
    """The fields of a chat, Messages or Responses request that only a render endpoint answers."""

    return_prompt_ref: bool
    previous_turn: PreviousTurn | None


def refuse_render_only(req: _RenderOnlyFields) -> None:
    """What only a render endpoint answers is refused, not ignored: the gateway's answers have no place for a prompt
    reference, and it runs the whole prompt."""
    if req.return_prompt_ref:
        raise bad_request("return_prompt_ref is answered by the render endpoints (/v1/chat/completions/render, "
                          "/v1/messages/render, /v1/responses/render); the gateway takes the reference they "
                          "answer in previous_turn.prompt_ref", "return_prompt_ref")
    if req.previous_turn is not None and req.previous_turn.answer != "full":
        raise bad_request("previous_turn.answer \"appended\" is answered by the render endpoints; the gateway "
                          "runs the whole prompt", "previous_turn.answer")


def _check_supported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.echo and isinstance(req, ChatCompletionRequest):
        raise bad_request("echo is not supported by the gateway's chat completions (completions support it)", "echo")
    if isinstance(req, ChatCompletionRequest):
        refuse_render_only(req)
    # Only the render tier's own keys (ids rendered already, prerendered.py); the gateway sets the engines'.
    if req.kv_transfer_params is not None and not set(req.kv_transfer_params) <= RENDER_KEYS:
        raise bad_request("kv_transfer_params are set by the gateway, not by clients (except prompt_token_ids "
                          "and render_fingerprint: a prompt rendered already)", "kv_transfer_params")


# ------------------------------------------------------------------------------------ driving


async def respond(request: Request, gateway: Gateway, gens: list[GenerateRequest],
                  responder: ChatResponder | CompletionResponder, stream: bool,
                  conversation: bytes | None = None) -> Response | SseRelay:
    gateway.stats.requests += 1
    if gateway.disaggregated:
        violation = fanout_violation(gens, gateway.settings.max_num_seqs)
        if violation:
            raise bad_request(violation, "n")
    planned = plan_streams(gens, gateway.disaggregated)
    # KV reuse across turns needs one decode sequence per turn (with n > 1, which one continues is unknown)
    call = EngineCall(conversation=conversation if gateway.disaggregated and len(planned) == 1 else None,
                      tenant=request_tenant(request, gateway))
    span_done = responder.span_done if responder.stops else None
    if not stream:
        return await collect(request, gateway, call, fold(gateway, planned, call, responder, span_done), responder)
    # Wait for the first events before answering: errors until then keep their HTTP status.
    try:
        streams = await open_merged(gateway, planned, call, span_done)
    except BaseException as exc:
        gateway.abort_soon(call)
        raise engine_error(exc) from None
    _pass_prompt_logprobs(streams, responder)
    return SseRelay(gateway, call, streams, responder)


async def fold(gateway: Gateway, planned: list[EngineStream], call: EngineCall,
               responder: ChatResponder | CompletionResponder, span_done: SpanDone | None) -> None:
    """A non-streamed request: its events are folded into the responder in the engine connections' data
    callbacks (as the streamed path writes them, sse_relay.py); this task wakes for the first events and
    the end only."""
    streams = await open_merged(gateway, planned, call, span_done)
    _pass_prompt_logprobs(streams, responder)
    over: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_choice(prompt_index: int, choice: GenerateStreamChoice) -> None:
        if over.done():
            return
        try:
            responder.accumulate(prompt_index, choice)
        except Exception as exc:
            streams.close()
            over.set_exception(exc)

    def on_items(items: list[tuple[int, GenerateStreamChoice]]) -> None:
        for prompt_index, choice in items:
            on_choice(prompt_index, choice)

    def on_over(error: Exception | None) -> None:
        if over.done():
            return
        if error is None:
            over.set_result(None)
        else:
            over.set_exception(error)

    try:
        streams.start(on_choice, on_items, on_over)
        await over
    finally:
        streams.close()  # nothing once they ended; cancelled (client gone): closes the engine connections


def _pass_prompt_logprobs(streams: MergedStreams, responder: ChatResponder | CompletionResponder) -> None:
    """The prompt logprobs of the prompts that asked for them (only chat and completions requests ask)."""
    prompt_logprobs = streams.prompt_logprobs()
    if prompt_logprobs:
        responder.prompt_logprobs_from(prompt_logprobs)


def engine_error(exc: BaseException) -> BaseException:
    """A failure before anything reached the client, as the HTTP error it is (others unchanged)."""
    if isinstance(exc, EngineRejected):
        return ApiError(exc.message(), exc.status, exc.param())
    if isinstance(exc, NoReplica):
        return ApiError(str(exc), 503, type="ServiceUnavailableError")
    if isinstance(exc, EngineStreamBroken):
        return ApiError(str(exc), 502, type="BadGatewayError")
    return exc


async def collect(request: Request, gateway: Gateway, call: EngineCall, folding: Coroutine[Any, Any, None],
                   responder: ChatResponder | CompletionResponder) -> Response:
    work = asyncio.ensure_future(folding)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and not client_went_away(gone):
            await asyncio.wait({work})  # the watcher failed without seeing the client go: finish unwatched
    finally:
        if not work.done():
            gateway.abort_soon(call)
            work.cancel()
        gone.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    # 499 only for a client that went away (nobody reads it; it is for the access log). A fold cancelled
    # by anything else is our failure and must not be blamed on a client that is still waiting.
    if client_went_away(gone) and work.cancelled():
        return Response(error_body(ApiError("client disconnected", 499)), status_code=499,
                        media_type="application/json")
    if work.cancelled():
        logger.error("engine calls of %s were cancelled with the client still there", responder.response_id)
        raise ApiError("the engine call was cancelled", 502, type="BadGatewayError")
    exc = work.exception()
    if exc is not None:
        if isinstance(exc, EngineStreamBroken):
            gateway.stats.stream_errors += 1
            metrics.STREAM_ERRORS.inc()
        raise engine_error(exc)
    return Response(_encode(responder.response()), media_type="application/json")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def client_went_away(watcher: asyncio.Future[Any]) -> bool:
    """The disconnect watcher returned: it saw ``http.disconnect`` (not cancelled, not failed)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None
