"""The render tier's own JSON endpoints answered from uvicorn's HTTP protocol, without the ASGI round trip.

Through uvicorn and ASGI a render request takes a request-response cycle with its event, ASGI message dicts,
the ops middleware's send wrapper, and Starlette's response sending its head and body as two messages: about
0.1 ms of a ~1.2 ms render of a 32k-token agent turn (bench/experiments/direct_http_ab.py). ``direct_protocol`` gives
uvicorn's protocol class one shortcut: a ``POST`` to one of ``DIRECT_PATHS`` whose body is declared up front
(HTTP/1.1, ``Content-Length`` up to ``DIRECT_MAX_BODY``, no ``Expect: 100-continue``), with no request of the
connection still in progress, has its body collected by the protocol, its endpoint (the same ``endpoint``
wrapper: auth, error envelope, metrics) run on a task, and its response written at once. What the ops
middleware does for every request is done here too (splitserve_common.lifecycle): the request id (echoed, in
the logs), 503 while draining, requests in flight, the access log line.

Everything else takes the usual way: other paths and methods, chunked or larger bodies, a request pipelined
behind one in progress, and any request once the connection has an upgrade. The parsing, keep-alive timer,
pipelining, header deadline and graceful shutdown stay uvicorn's (and connection_timeouts'): the shortcut
stands in for uvicorn's cycle object only where those read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from render_service.http.errors import ApiError, error_body
from splitserve_common.lifecycle import DRAINING_BODY, DRAINING_HEADERS, Lifecycle, client_request_id, log_access
from splitserve_common.logs import request_id_var

logger = logging.getLogger("render_service.direct_http")

# A body up to this size renders on the event loop anyway (render_queue.BULK_BODY_BYTES); larger ones take the
# usual path, where uvicorn's flow control holds the rest of the body until the endpoint reads it.
DIRECT_MAX_BODY = 256 * 1024

DirectHandler = Callable[[Any], Awaitable[Response]]
# (scope, receive) -> the request object the handlers take (server.RawRequest)
RequestFactory = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]]], Any]

_STATUS_LINES: dict[int, bytes] = {}
_DRAINING_HEADERS = [*DRAINING_HEADERS, (b"content-length", b"%d" % len(DRAINING_BODY))]
_INTERNAL_ERROR = Response(error_body(ApiError("Internal server error", 500)), status_code=500,
                           media_type="application/json")


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE

        line = _STATUS_LINES[status] = STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status
    return line


class _DisconnectWaiter:
    """uvicorn's protocol sets its cycle's ``message_event`` when the connection is lost."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        self.lost: asyncio.Event | None = None

    def set(self) -> None:
        if self.lost is not None:
            self.lost.set()


class DirectCycle:
    """A direct request in progress, read by uvicorn's protocol (and the header deadline) as its ``cycle``."""

    __slots__ = ("scope", "handler", "body", "keep_alive", "response_complete", "disconnected", "message_event")

    def __init__(self, scope: dict[str, Any], handler: DirectHandler, keep_alive: bool) -> None:
        self.scope = scope
        self.handler = handler
        self.body: list[bytes] = []
        self.keep_alive = keep_alive  # (uvicorn's shutdown() clears it: the connection closes after the response)
        self.response_complete = False
        self.disconnected = False
        self.message_event = _DisconnectWaiter()

    async def receive(self) -> dict[str, Any]:
        """ASGI's receive for the endpoint: the whole body, then (if asked again) the connection's loss."""
        body = self.body
        if body is not None:
            self.body = None  # type: ignore[assignment]
            return {"type": "http.request", "body": b"".join(body), "more_body": False}
        waiter = self.message_event
        if not self.disconnected:
            waiter.lost = waiter.lost or asyncio.Event()
            await waiter.lost.wait()
        return {"type": "http.disconnect"}


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length of a request without Transfer-Encoding, else None."""
    length = None
    for name, value in headers:
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            return None
    return length


# What the shortcut reads and calls of uvicorn's httptools protocol (its private surface: uvicorn is pinned to a
# minor version, and ``protocol_violation`` checks these at start, falling back to the usual path if one moved).
PROTOCOL_METHODS = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete")
PROTOCOL_ATTRIBUTES = ("self.cycle", "self.parser", "self.expect_100_continue", "self.url", "self.headers",
                       "self.tasks", "self.transport", "self.server_state", "self.loop")


def protocol_violation(base: type) -> str | None:
    """None when ``base`` has every method the shortcut overrides or calls and sets every attribute it reads (in
    its source), and uvicorn's status lines and default headers are where they were; else what moved."""
    import inspect

    from uvicorn.protocols.http import httptools_impl

    for name in PROTOCOL_METHODS:
        if not callable(getattr(base, name, None)):
            return f"uvicorn's protocol has no {name}"
    try:
        source = "".join(inspect.getsource(cls) for cls in base.__mro__ if cls.__module__.startswith("uvicorn."))
    except (OSError, TypeError):
        return "uvicorn's protocol source cannot be read"
    for attribute in PROTOCOL_ATTRIBUTES:
        if attribute not in source:
            return f"uvicorn's protocol no longer sets {attribute}"
    if not isinstance(getattr(httptools_impl, "STATUS_LINE", None), dict):
        return "uvicorn's STATUS_LINE moved"
    if "default_headers" not in inspect.getsource(httptools_impl) + source:
        return "uvicorn's server state has no default_headers"
    return None


def direct_protocol(base: type, routes: dict[bytes, DirectHandler], app: Any, make_request: RequestFactory,
                    lifecycle: Lifecycle, access_log: bool) -> type:
    """``base`` (uvicorn's httptools protocol, possibly with the header deadline) answering ``POST`` requests to
    the paths of ``routes`` (raw paths) directly; ``app``: the application the handlers read their state from
    (``scope["app"]``, as RenderApp sets it); ``make_request``: the handlers' request object."""

    class DirectHttp(base):  # type: ignore[misc]
        cycle: Any  # uvicorn's RequestResponseCycle, or a DirectCycle

        def on_headers_complete(self) -> None:
            cycle = self.cycle
            parser = self.parser
            if ((cycle is None or cycle.response_complete) and not self.expect_100_continue
                    and parser.get_method() == b"POST" and parser.get_http_version() == "1.1"
                    and not parser.should_upgrade()):
                handler = routes.get(self.url)
                if handler is not None:
                    length = _declared_length(self.headers)
                    if length is not None and length <= DIRECT_MAX_BODY:
                        scope = {"type": "http", "method": "POST", "path": self.url.decode("ascii"),
                                 "headers": self.headers, "app": app}
                        self.cycle = DirectCycle(scope, handler, parser.should_keep_alive())
                        return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is DirectCycle:
                cycle.body.append(body)
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if type(cycle) is DirectCycle:
                task = self.loop.create_task(self._answer(cycle))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)  # (uvicorn's shutdown waits for its tasks)
                return
            super().on_message_complete()

        async def _answer(self, cycle: DirectCycle) -> None:
            scope = cycle.scope
            request_id = client_request_id(scope["headers"]) or uuid.uuid4().hex
            token = request_id_var.set(request_id)
            started = time.perf_counter()
            status = 0
            body: list[bytes | memoryview]
            try:
                if lifecycle.draining:
                    status, headers, body = 503, _DRAINING_HEADERS, [DRAINING_BODY]
                    cycle.keep_alive = False
                else:
                    lifecycle.in_flight += 1
                    try:
                        response = await cycle.handler(make_request(scope, cycle.receive))
                    except Exception:  # (endpoint() answers its own errors: this is a bug of ours)
                        logger.exception("internal error on %s", scope["path"])
                        response = _INTERNAL_ERROR
                    finally:
                        lifecycle.in_flight -= 1
                    status, headers = response.status_code, response.raw_headers
                    body = getattr(response, "pieces", None) or [response.body]
                self._write(cycle, status, headers, body, request_id)
            finally:
                if access_log:
                    log_access("POST", scope["path"], status, started)
                request_id_var.reset(token)

        def _write(self, cycle: DirectCycle, status: int, headers: list[tuple[bytes, bytes]],
                   body: list[bytes | memoryview], request_id: str) -> None:
            cycle.response_complete = True
            if cycle.disconnected or self.transport.is_closing():
                return
            head = [_status_line(status)]
            for name, value in self.server_state.default_headers:
                head += (name, b": ", value, b"\r\n")
            closes = False
            for name, value in headers:
                if name == b"connection":
                    closes = closes or b"close" in value.lower()
                if name != b"x-request-id":
                    head += (name, b": ", value, b"\r\n")
            head += (b"x-request-id: ", request_id.encode(), b"\r\n")
            if not cycle.keep_alive and not closes:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            self.transport.writelines([b"".join(head), *body])
            if closes or not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()  # uvicorn's: the next pipelined request, or the keep-alive timer

    DirectHttp.__name__ = DirectHttp.__qualname__ = f"Direct{base.__name__}"
    return DirectHttp
