"""What every handler of the render tier (and of its gateway and API adapters) uses of a request: the JSON
body read and decoded with msgspec, the JSON answer, vLLM's error envelope, the API-key check, the metrics,
and the app's shared state. The app (server.py) is built from handlers that import these; none of this
imports a handler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from render_service.derender.stream import StreamRuntime
from render_service.http import metrics
from render_service.http.errors import ApiError, bad_request, error_body, from_decode_error
from render_service.http.render_queue import RenderQueue
from render_service.multimodal.chat import MultimodalRender
from render_service.render.fingerprint import FINGERPRINT_HEADER
from render_service.render.render_config import RenderConfig
from render_service.tokenize.incremental_tokenizer import PromptIds
from splitserve_common.auth import ApiKeys

logger = logging.getLogger("render_service.server")

JSON = "application/json"
# Upper bound on a request body: a full 128k-token context with its chat request fits many times over.
MAX_BODY_BYTES = 64 * 1024 * 1024


def _json_view(value: Any) -> Any:
    """Integers kept as the chunks they were made of (``PromptIds``: prompt ids from the piece cache, a prompt
    reference's ids and masks) are written from their JSON."""
    if isinstance(value, PromptIds):
        return value.json_array()
    raise NotImplementedError(f"Objects of type {type(value).__name__} are not JSON serializable")


encode_json = msgspec.json.Encoder(enc_hook=_json_view).encode
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: type) -> Any:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request("Invalid JSON body: nested too deeply") from None


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode_json(payload), status_code=status, media_type=JSON, headers=headers)


class PiecesResponse(Response):
    """A JSON answer written as the pieces it is made of, never joined into one body (an image render's answer:
    the JSON around each image's item, and the items as the cache holds them). The direct path writes
    ``pieces`` too."""

    def __init__(self, pieces: list[bytes | memoryview], headers: dict[str, str] | None = None) -> None:
        super().__init__(b"", media_type=JSON, headers=headers)
        self.pieces = pieces
        self.headers["content-length"] = str(sum(len(piece) for piece in pieces))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for at, piece in enumerate(self.pieces, 1):
            await send({"type": "http.response.body", "body": piece, "more_body": at < len(self.pieces)})


def error_response(error: ApiError) -> Response:
    return Response(error_body(error), status_code=error.status, media_type=JSON, headers=error.headers)


def version() -> str:
    try:
        from importlib.metadata import version as package_version

        return package_version("splitserve")
    except Exception:  # not installed as a distribution (plain checkout)
        return "0.0.0+unknown"


class Answer(Protocol):
    """What a handler answers: a Starlette Response, or an ASGI app of its own that has a status (the gateway's
    SSE relay writes a stream's events from the engine connections' callbacks)."""

    status_code: int

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


Handler = Callable[[Request], Awaitable[Answer]]


@dataclass
class ServerState:
    """One app's configuration and what its handlers share (``app.state.server``)."""

    config: RenderConfig
    stream_runtime: StreamRuntime
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys(None))  # --api-key: one or several (rotation)
    render_queue: RenderQueue = field(default_factory=RenderQueue)
    multimodal: MultimodalRender | None = None  # images, for a covered vision-language model
    created: int = field(default_factory=lambda: int(time.time()))
    version: str = field(default_factory=version)

    @property
    def render_headers(self) -> dict[str, str]:
        # The fingerprint also rides on a response header, for callers that keep headers but not body keys.
        return {FINGERPRINT_HEADER: self.config.fingerprint}


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.scope["app"].state.server


def client_of(request: Request) -> str:
    """The client ``request`` comes from, as the server's keys tell it (``ApiKeys.client_of``)."""
    return server_state(request).api_keys.client_of(request.headers.get("authorization"))


async def read_json_body(request: Request) -> bytes:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != JSON:
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(f"Request body larger than {MAX_BODY_BYTES} bytes", 413)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(f"Request body larger than {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def check_auth(request: Request) -> None:
    keys = server_state(request).api_keys
    if keys and not keys.accepts(request.headers.get("authorization")):
        raise ApiError("Unauthorized: missing or invalid API key", 401)


def endpoint(name: str, handler: Handler, *, auth: bool = True) -> Handler:
    """Wraps a handler with auth, the error envelope and metrics."""

    async def run(request: Request) -> Answer:
        started = time.perf_counter()
        response: Answer
        try:
            if auth:
                check_auth(request)
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except ClientDisconnect:
            response = Response(b"", status_code=499)  # nobody is listening; nginx's code for it
        except MemoryError:
            # What this request asked for did not fit (the templates and limits bound the usual ways): its
            # own failure, answered as such, never a 500.
            logger.warning("request on %s ran out of memory", name)
            response = error_response(ApiError("The request needs more memory than this server can give it", 400))
        except Exception:
            logger.exception("internal error on %s", name)
            response = error_response(ApiError("Internal server error", 500))
        metrics.observe_request(name, response.status_code, time.perf_counter() - started)
        return response

    return run
