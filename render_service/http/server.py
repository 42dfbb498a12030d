"""The render server: a Starlette app over render/render.py and derender/batch.py.

Bodies are decoded and encoded with msgspec (a 9k-token prompt's JSON must not go through Python's
json module). Render work (render, /tokenize, /detokenize) goes through the render queue
(render_queue.py): large bodies on a thread of their own, so the event loop keeps answering /health and
derender while a huge prompt tokenizes; requests that wait are counted, and a full queue answers 429.
Derender stays on the loop: its work per chunk is small and bounded. One process is one core's worth of
work; the CLI starts several for several cores.

Every failure a client can cause is answered with vLLM's error envelope and a 4xx; anything else is
logged with its traceback and answered 500 (a bug of ours), never left hanging.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import Future
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.apis.derender import OUTPUT_TEXTS
from render_service.apis.endpoints import api_routes
from render_service.derender.batch import derender_chat, derender_completion
from render_service.derender.stream import StreamRuntime, derender_chat_stream, derender_completion_stream
from render_service.gateway.api_routes import api_gateway_routes
from render_service.gateway.flow import Gateway
from render_service.gateway.routes import gateway_routes
from render_service.http import metrics
from render_service.http.errors import ApiError, bad_request
from render_service.http.render_queue import RenderQueue
from render_service.http.request_io import (
    JSON,
    PiecesResponse,
    ServerState,
    client_of,
    decode,
    encode_json,
    endpoint,
    error_response,
    json_response,
    read_json_body,
    server_state,
)
from render_service.multimodal.chat import MultimodalRender
from render_service.multimodal.endpoint import render_with_images
from render_service.multimodal.features import answer_pieces
from render_service.render.render import add_special_tokens, render_chat, render_chat_prompt, render_completion
from render_service.render.render_config import RenderConfig, check_model
from render_service.tokenize.incremental_tokenizer import PromptIds
from render_service.wire.message_memo import carries_image_parts, decode_chat_request
from render_service.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderCompletionRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamProbe,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeRequest,
    TokenizeResponse,
)
from splitserve_common.auth import ApiKeys

logger = logging.getLogger("render_service.server")

# ------------------------------------------------------------------------------------- the app


class RawRequest:
    """What the handlers use of a request (headers, method, body stream), built straight from ASGI."""

    __slots__ = ("scope", "headers", "_receive")

    def __init__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[dict]]) -> None:
        self.scope = scope
        self.headers = Headers(scope=scope)
        self._receive = receive

    @property
    def method(self) -> str:
        return self.scope["method"]

    @property
    def receive(self) -> Callable[[], Awaitable[dict]]:
        return self._receive  # as Starlette's Request.receive (the gateway watches for disconnects)

    async def stream(self):
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            body = message.get("body", b"")
            if body:
                yield body
            if not message.get("more_body", False):
                return


class RenderApp(Starlette):
    """Starlette, except that the render tier's own endpoints skip its router and middleware layers.

    Those layers cost ~0.1 ms a request, a large share of a streaming-derender chunk. The fast routes
    are wrapped by the same ``endpoint`` (auth, error envelope, metrics) as the routed ones.
    """

    fast_routes: dict[tuple[str, str], Callable[[Any], Awaitable[Response]]] = {}

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            handler = self.fast_routes.get((scope["method"], scope["path"]))
            if handler is not None:
                scope["app"] = self
                response = await handler(RawRequest(scope, receive))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


# -------------------------------------------------------------------------------------- handlers


_EMPTY_IDS = msgspec.Raw(b"[]")
_IDS_KEY = b'"token_ids":['


def _encode_generate_request(gen: GenerateRequest) -> bytes:
    """Its JSON; prompt ids that came from the piece cache are written from the pieces' JSON, joined once into
    the whole response (a 32k-token prompt's ids are ~150 KB: each extra copy is a few percent of a render)."""
    ids = gen.token_ids
    if not isinstance(ids, PromptIds) or not ids.json_parts:  # (encode_json writes a view's JSON itself)
        return encode_json(gen)
    parts = ids.json_parts
    whole = encode_json(msgspec.structs.replace(gen, token_ids=_EMPTY_IDS))
    # The first '"token_ids":[' is the field's: only request_id comes before it, and a JSON string cannot hold
    # an unescaped quote.
    cut = whole.index(_IDS_KEY) + len(_IDS_KEY)
    if len(parts) == 1:
        return whole[:cut] + parts[0] + whole[cut:]
    return b",".join([whole[:cut] + parts[0], *parts[1:-1], parts[-1] + whole[cut:]])


def _observe_prompt_cache(config: RenderConfig) -> None:
    encoder = config.prompt_encoder
    if encoder is not None:
        metrics.observe_prompt_cache(*encoder.take_counts())
    if config.caches is not None:  # every cache's counters, at most once a second (caches/budget.py)
        config.caches.observe()


async def chat_render(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_body(request)
    request_id = request.headers.get("x-request-id")
    client = client_of(request)

    def render_text(req: ChatCompletionRequest) -> bytes:
        result = render_chat(req, state.config, request_id=request_id, ids_view=True, client=client)
        metrics.PROMPT_TOKENS.inc(len(result.token_ids))
        _observe_prompt_cache(state.config)
        return _encode_generate_request(result)

    def job() -> bytes | ChatCompletionRequest:
        req = decode_chat_request(body, state.config.message_memo, decode)
        # Images are found in the decoded messages (the memo decodes only a conversation's new ones), not by a
        # scan of the whole body: an agent's growing conversation costs what its new turn costs.
        return req if carries_image_parts(req.messages) else render_text(req)

    done = await state.render_queue.run("chat_render", len(body), job)
    if isinstance(done, bytes):
        return Response(done, media_type=JSON, headers=state.render_headers)
    with_images = await render_with_images(  # the image path (multimodal.endpoint)
        body, done, state.config, state.multimodal, state.render_queue,
        lambda chat, expand: render_chat(chat, state.config, request_id=request_id, expand_prompt=expand,
                                         client=client))
    if with_images is not None:
        metrics.PROMPT_TOKENS.inc(len(with_images.token_ids))
        return PiecesResponse(answer_pieces(with_images, _encode_generate_request), state.render_headers)
    payload = await state.render_queue.run("chat_render", len(body), lambda: render_text(done))
    return Response(payload, media_type=JSON, headers=state.render_headers)


async def completion_render(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_body(request)
    request_id = request.headers.get("x-request-id")

    def job() -> bytes:
        results = render_completion(decode(body, CompletionRequest), state.config, request_id=request_id)
        metrics.PROMPT_TOKENS.inc(sum(len(r.token_ids) for r in results))
        _observe_prompt_cache(state.config)
        return b"[" + b",".join(_encode_generate_request(r) for r in results) + b"]"

    payload = await state.render_queue.run("completion_render", len(body), job)
    return Response(payload, media_type=JSON, headers=state.render_headers)


async def _derender(request: Request, batch_type: type, derender_batch: Callable[..., Any], stream_type: type,
                    derender_stream: Callable[..., Any]) -> Response:
    """A derender endpoint: a body with ``stream: true`` is one streamed chunk, any other a whole response."""
    state = server_state(request)
    body = await read_json_body(request)
    if decode(body, DerenderStreamProbe).stream:
        stream_req = decode(body, stream_type)
        return json_response(derender_stream(stream_req, state.config, state.stream_runtime, request.headers))
    req = decode(body, batch_type)
    result = derender_batch(req, state.config, request.headers)
    metrics.COMPLETION_TOKENS.inc(result.usage.completion_tokens or 0)
    return json_response(result)


async def chat_derender(request: Request) -> Response:
    return await _derender(request, DerenderChatRequest, derender_chat, DerenderChatStreamRequest,
                           derender_chat_stream)


async def completion_derender(request: Request) -> Response:
    return await _derender(request, DerenderCompletionRequest, derender_completion, DerenderCompletionStreamRequest,
                           derender_completion_stream)


async def _queued(request: Request, endpoint: str, work: Callable[[bytes, RenderConfig], bytes]) -> Response:
    """A body's JSON answer computed on the render queue (large bodies off the event loop)."""
    state = server_state(request)
    body = await read_json_body(request)
    return Response(await state.render_queue.run(endpoint, len(body), lambda: work(body, state.config)),
                    media_type=JSON)


async def tokenize(request: Request) -> Response:
    return await _queued(request, "tokenize", _tokenize)


def _tokenize(body: bytes, config: RenderConfig) -> bytes:
    req = decode(body, TokenizeRequest)
    check_model(req.model, config)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("tokenize takes exactly one of `prompt` or `messages`")
    if req.prompt is not None:
        ids = config.tokenizer.encode(req.prompt)
        if req.add_special_tokens is not False:
            ids = add_special_tokens(ids, config)
    else:
        chat = ChatCompletionRequest(
            messages=req.messages, tools=req.tools, chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        ids, _ = render_chat_prompt(chat, config)  # the same path as /render
        if req.add_special_tokens:
            ids = add_special_tokens(ids, config)
    strs = None
    if req.return_token_strs:
        strs = [config.tokenizer.id_to_token(t) or "" for t in ids]
    return encode_json(TokenizeResponse(count=len(ids), max_model_len=config.max_model_len, tokens=ids,
                                    token_strs=strs))


async def detokenize(request: Request) -> Response:
    return await _queued(request, "detokenize", _detokenize)


def _detokenize(body: bytes, config: RenderConfig) -> bytes:
    req = decode(body, DetokenizeRequest)
    check_model(req.model, config)
    vocab = config.tokenizer.vocab_size
    for t in req.tokens:
        if not 0 <= t < vocab:
            raise bad_request(f"Token id {t} is out of vocabulary", "tokens")
    return encode_json(DetokenizeResponse(prompt=config.tokenizer.decode(req.tokens, skip_special_tokens=False)))


async def models(request: Request) -> Response:
    state = server_state(request)
    config = state.config
    cards = [
        ModelCard(id=name, created=state.created, root=str(config.bundle.path), max_model_len=config.max_model_len,
                  permission=[ModelPermission(id=f"modelperm-{name}", created=state.created)])
        for name in config.served_model_names
    ]
    return json_response(ModelList(data=cards))


async def health(request: Request) -> Response:
    return Response(b"", status_code=200)


async def version_endpoint(request: Request) -> Response:
    state = server_state(request)
    return json_response({"version": state.version, "render_fingerprint": state.config.fingerprint})


async def load(request: Request) -> Response:
    """vLLM's ``/load``: the requests this process is working on (renders running and queued), for routers."""
    queue = server_state(request).render_queue
    return json_response({"server_load": queue.running + queue.waiting})


async def not_served(request: Request) -> Response:
    """A render route vLLM has and we do not serve: 501, as vLLM answers for an API its model lacks."""
    raise ApiError(f"{request.scope['path']} is not served by this render tier", 501, type="NotImplementedError")


async def metrics_endpoint(request: Request) -> Response:
    caches = server_state(request).config.caches
    if caches is not None:
        caches.observe(force=True)
    return Response(metrics.render_metrics(), media_type=metrics.CONTENT_TYPE_LATEST)


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(f"Not found: {request.method} {request.url.path}", 404))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(f"Method {request.method} not allowed on {request.url.path}", 405))


async def server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(ApiError("Internal server error", 500))


def own_routes() -> list[Route]:
    return api_routes() + [
        Route("/v1/chat/completions/render", endpoint("chat_render", chat_render), methods=["POST"]),
        Route("/v1/completions/render", endpoint("completion_render", completion_render), methods=["POST"]),
        Route("/v1/chat/completions/derender", endpoint("chat_derender", chat_derender), methods=["POST"]),
        Route("/v1/completions/derender", endpoint("completion_derender", completion_derender), methods=["POST"]),
        Route("/tokenize", endpoint("tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("detokenize", detokenize), methods=["POST"]),
        Route("/v1/models", endpoint("models", models), methods=["GET"]),
        Route("/health", endpoint("health", health, auth=False), methods=["GET"]),
        Route("/ping", endpoint("ping", health, auth=False), methods=["GET", "POST"]),  # SageMaker's, as vLLM
        Route("/version", endpoint("version", version_endpoint, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("metrics", metrics_endpoint, auth=False), methods=["GET"]),
        Route("/load", endpoint("load", load, auth=False), methods=["GET"]),
        *(Route(path, endpoint("not_served", not_served), methods=["POST"]) for path in NOT_SERVED_RENDER_PATHS),
    ]


# Render routes of vLLM 0.34's render server that this tier does not serve (answered 501, not 404, as vLLM does).
NOT_SERVED_RENDER_PATHS = ("/cohere/v2/chat/render",)


# The render tier's own POST endpoints, each answered with one JSON Response: the ones direct_http.py may answer
# from the HTTP protocol itself.
DIRECT_PATHS = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/chat/completions/derender",
                "/v1/completions/derender", "/tokenize", "/detokenize")


def direct_routes(app: RenderApp) -> dict[bytes, Callable[[Any], Awaitable[Response]]]:
    """The app's handlers (wrapped by ``endpoint``) of ``DIRECT_PATHS``, by raw path."""
    return {path.encode(): app.fast_routes[("POST", path)] for path in DIRECT_PATHS}


# Encoded on the bulk lane when a serving process starts (RenderQueue.warm): words, digits, punctuation, code and
# characters outside ASCII, so that each part of the encoder that sets up per-thread state runs once.
WARM_TEXT = "Warm-up: the render lane's first encode, 2026-01-01 {\"a\": [1, 2.5]} été 你好 🙂\n\tdef f(x): return x"


def warm_render_lanes(app: Starlette) -> Future[object]:
    """Starts the bulk lane's thread with one encode (http/render_queue.RenderQueue.warm); in the serving process.
    A warm-up that fails is logged and costs nothing else: the lane works as it would have."""
    state = app.state.server

    def encode() -> object:
        try:
            return state.config.tokenizer.encode(WARM_TEXT)
        except Exception:
            logger.exception("the bulk render lane's warm-up encode failed")
            return None

    return state.render_queue.warm(encode)


def create_app(
    config: RenderConfig, *, api_key: str | list[str] | None = None, stream_state_secret: str | None = None,
    gateway: Gateway | None = None, max_queued_requests: int | None = None, multimodal: MultimodalRender | None = None,
) -> Starlette:
    """The render server for one loaded configuration (plus the gateway routes when given a Gateway): the
    composition root, where the render tier's own handlers, the API adapters' and the gateway's meet.
    ``multimodal``: how to render images for a covered vision-language model (``multimodal.setup``)."""
    # stream_state signing secret: the argument, else SPLITSERVE_STREAM_STATE_SECRET, else unsigned.
    state = ServerState(config, StreamRuntime(stream_state_secret), api_keys=ApiKeys(api_key),
                        render_queue=RenderQueue(max_queued_requests), multimodal=multimodal)
    if config.prompt_refs is not None:  # with keys, several clients: each may hold a quarter
        refs = config.prompt_refs
        refs.client_bytes = refs.max_bytes // 4 if state.api_keys else refs.max_bytes
    if config.caches is not None:  # the caches outside --render-cache-bytes show on /metrics beside the others
        config.caches.register("stream_history", state.stream_runtime.cache.stats)
        config.caches.register("output_texts", OUTPUT_TEXTS.stats)
        if multimodal is not None:
            config.caches.register("images", multimodal.pool.cache.stats)
    routes = own_routes()
    if gateway is not None:
        routes += gateway_routes(gateway, config, state.render_queue)
        routes += api_gateway_routes(gateway, config)  # /v1/responses, /v1/messages
    app = RenderApp(
        routes=routes,
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error},
    )
    app.fast_routes = {
        (method, route.path): route.endpoint
        for route in routes  # the gateway's too: per streamed token, Starlette's layers wrap every send
        for method in route.methods or ()
        if method != "HEAD" and not route.param_convertors  # a templated path goes through the router
    }
    app.state.server = state
    app.state.render_config = config
    metrics.set_model_name(config.model_name)
    return app
