"""Request ids, in-flight accounting and draining, for any Starlette app behind uvicorn.

``OpsMiddleware`` wraps the whole app (pure ASGI, so streaming responses pass straight through):
it honours and echoes X-Request-Id, logs one access line per request, counts requests in flight
and, once draining, answers new work with 503 and /health with 503 so readiness drops.

``DrainingServer`` is uvicorn's Server with a different SIGTERM: instead of closing the listening
socket at once (new clients would see "connection refused" and probes would fail without a reason),
it keeps listening while draining, and exits when nothing is in flight or the grace period is over.
A second SIGTERM/SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import uvicorn

from splitserve_common.logs import request_id_var
from splitserve_common.request_ids import header_safe

logger = logging.getLogger("splitserve.ops")
access_logger = logging.getLogger("splitserve.access")

# Probes and scrapes are neither work nor refused while draining (Prometheus should see the drain).
UNCOUNTED_PATHS = frozenset({"/health", "/ping", "/load", "/metrics"})
DRAINING_BODY = (b'{"error":{"message":"The server is shutting down; retry on another replica",'
                 b'"type":"ServiceUnavailableError","param":null,"code":503}}')
# Connection: close moves a keep-alive client to another replica on its next request.
DRAINING_HEADERS = [(b"content-type", b"application/json"), (b"connection", b"close"), (b"retry-after", b"1")]
# How long a draining process that stopped accepting still reads requests on connections it already accepted.
ACCEPTED_REQUEST_SETTLE_SECONDS = 0.5


class RequestTiming(Protocol):
    """Latency observer for chosen paths (the gateway's histograms): ``endpoint`` names the path's label, or
    None when the path is not timed; the middleware then reports the first byte of a successful stream and
    the end of a successful response."""

    def endpoint(self, path: str) -> str | None: ...

    def stream_started(self, endpoint: str, seconds: float) -> None: ...

    def finished(self, endpoint: str, seconds: float) -> None: ...


class Lifecycle:
    """Draining state and requests in flight for one server process."""

    def __init__(self, grace_seconds: float = 30.0, busy: Callable[[], bool] | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.busy = busy  # further work that must finish before exit (an engine's held KV leases)
        self.in_flight = 0
        self.draining = False
        self.drain_deadline = float("inf")

    def start_draining(self) -> None:
        # Called from a signal handler: no logging here (it would run inside whatever request the
        # signal interrupted, and carry its request id); the server's tick logs the drain.
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.grace_seconds

    def drained(self) -> bool:
        """True once the process may exit: nothing left in flight, or the grace period is over."""
        if self.in_flight == 0 and not (self.busy and self.busy()):
            return True
        if time.monotonic() >= self.drain_deadline:
            logger.warning("grace period over with %d requests in flight; exiting anyway", self.in_flight,
                           extra={"in_flight": self.in_flight})
            return True
        return False


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if header_safe(text) else None  # echoed and logged: never a client's odd bytes
    return None


class OpsMiddleware:
    def __init__(self, app: Any, lifecycle: Lifecycle, *, access_log: bool = True,
                 openapi: bytes | None = None, timing: RequestTiming | None = None) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.access_log = access_log
        self.openapi = openapi  # served at GET /openapi.json (see splitserve_common.openapi)
        self.timing = timing

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        request_id = client_request_id(scope.get("headers", [])) or uuid.uuid4().hex
        token = request_id_var.set(request_id)
        echoed = request_id.encode()
        status = 0
        counted = path not in UNCOUNTED_PATHS
        timing = self.timing
        timed = timing.endpoint(path) if timing is not None else None
        streaming = False
        started = time.perf_counter()

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = message["status"]
                streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", []))
                if timing is not None and timed and streaming and status == 200:
                    timing.stream_started(timed, time.perf_counter() - started)
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", echoed)]}
            await send(message)

        try:
            if self.lifecycle.draining and path != "/metrics":
                await self._refuse(send_with_id, path)
                return
            if path == "/openapi.json" and self.openapi is not None and scope.get("method") == "GET":
                await _send_body(send_with_id, 200, self.openapi, [(b"content-type", b"application/json")])
                return
            if counted:
                self.lifecycle.in_flight += 1
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                if counted:
                    self.lifecycle.in_flight -= 1
            if timing is not None and timed and status == 200:
                timing.finished(timed, time.perf_counter() - started)
        finally:
            if self.access_log:
                log_access(scope.get("method"), path, status, started, counted)
            request_id_var.reset(token)

    @staticmethod
    async def _refuse(send: Any, path: str) -> None:
        await _send_body(send, 503, b"" if path == "/health" else DRAINING_BODY, list(DRAINING_HEADERS))


# Paths that carry a stored response's id: whoever reads the log must not be able to fetch it with that id.
_SECRET_PATH_PREFIX = "/v1/responses/"
_SHOWN_ID_CHARS = 12


def loggable_path(path: str) -> str:
    """``path`` with a stored response's id shortened (its first characters, enough to correlate)."""
    if path.startswith(_SECRET_PATH_PREFIX):
        rest = path[len(_SECRET_PATH_PREFIX):]
        if rest not in ("render", "derender") and len(rest) > _SHOWN_ID_CHARS:
            return _SECRET_PATH_PREFIX + rest[:_SHOWN_ID_CHARS] + "..."
    return path


def log_access(method: str | None, path: str, status: int, started: float, counted: bool = True) -> None:
    """The access log's line for one request (``started``: its perf_counter at arrival); probes and scrapes
    (not ``counted``) at DEBUG."""
    path = loggable_path(path)
    access_logger.log(logging.INFO if counted else logging.DEBUG, "%s %s %d", method, path, status, extra={
        "method": method, "path": path, "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1e3, 3)})


async def _send_body(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains on the first SIGTERM/SIGINT and exits 0 (it does not re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True
            return
        self.lifecycle.start_draining()

    async def on_tick(self, counter: int) -> bool:
        lc = self.lifecycle
        if lc.draining and not self._drain_logged:
            self._drain_logged = True
            logger.info("draining: refusing new requests, %d in flight, grace %.0fs", lc.in_flight, lc.grace_seconds,
                        extra={"in_flight": lc.in_flight})
        if lc.draining and not self.should_exit and lc.drained():
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # Workers of one pre-forked server share a listening socket: this process may have accepted a connection
        # (a probe sent right after the SIGTERM) whose request has not been read yet. uvicorn's shutdown would
        # close it unanswered; stop accepting first and give such requests a moment to arrive and get their 503.
        if self.lifecycle.draining and not self.force_exit:
            for server in self.servers:
                server.close()
            await asyncio.sleep(ACCEPTED_REQUEST_SETTLE_SECONDS)
        await super().shutdown(sockets)


def wrap_app(app: Any, lifecycle: Lifecycle, *, access_log: bool = True,
             openapi: dict[str, Any] | None = None, timing: RequestTiming | None = None) -> OpsMiddleware:
    body = json.dumps(openapi).encode() if openapi is not None else None
    return OpsMiddleware(app, lifecycle, access_log=access_log, openapi=body, timing=timing)
