"""How long an HTTP connection may hold a server's socket without sending a whole request head.

uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``), but arms
no timer on a fresh connection, nor on one whose next request has started and stalls: a client that sends
nothing, or half a header and then a byte a minute (slowloris), holds its connection forever, and a few
thousand of them exhaust the server's file descriptors. ``header_deadline_protocol`` returns uvicorn's own
HTTP protocol class with one more deadline: from the moment a connection opens, or the first byte of its next
request arrives, the request line and headers must be complete within ``header_timeout_s`` and at most
``max_header_bytes`` long, else the connection is closed. Once the head is in, the application owns the
request (bodies and streamed responses have their own bounds: the body size cap, the engines' timeouts).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# vLLM's variable for uvicorn's keep-alive timeout, with vLLM's default
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
DEFAULT_KEEP_ALIVE_S = 5.0

_HEADERS_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                      b"content-length: 32\r\nconnection: close\r\n\r\nRequest header fields too large\n")


class HeaderDeadline:
    """Mixin over uvicorn's H11Protocol or HttpToolsProtocol (both keep the current request in ``cycle`` and
    the server's open connections in ``connections``).

    A request only stamps the time its head began (one float); one sweep per server, a few times per
    timeout, closes the connections whose head is overdue. A timer per request would cost more than the
    rest of this class on the per-chunk derender path.
    """

    # set by uvicorn's protocol classes
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    connections: set[Any]

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    _head_since: float | None = None  # loop time the current request head began; None while a request runs
    _head_bytes = 0

    def _between_requests(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_since = self.loop.time()
        _HeadSweep.ensure(self.loop, self.connections, self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        # (the per-request path: the cycle checks are inlined)
        if self._head_since is None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                # the next request's first bytes (idleness after a response is uvicorn's keep-alive timer)
                self._head_since = self.loop.time()
                self._head_bytes = 0
        if self._head_since is not None:
            # Counted before the parser sees the bytes: a head that arrives whole in one read (up to a few
            # hundred KiB) would otherwise be parsed and handed on before any count.
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4
            if self._head_bytes > self.max_header_bytes:
                if not self.transport.is_closing():
                    self.transport.write(_HEADERS_TOO_LARGE)
                    self.transport.close()
                return
        super().data_received(data)  # type: ignore[misc]
        if self._head_since is None:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._head_since = None  # the head is complete: the application has the request now

    def head_overdue(self, now: float) -> bool:
        since = self._head_since
        return since is not None and now - since >= self.header_timeout_s and self._between_requests()


class _HeadSweep:
    """One periodic check per server (its set of connections), running while it has connections."""

    _running: dict[int, _HeadSweep] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: set[Any], timeout_s: float) -> None:
        self.loop = loop
        self.connections = connections
        self.interval_s = min(1.0, timeout_s / 4)  # closes within timeout + interval
        self.loop.call_later(self.interval_s, self.sweep)

    @classmethod
    def ensure(cls, loop: asyncio.AbstractEventLoop, connections: set[Any], timeout_s: float) -> None:
        if id(connections) not in cls._running:
            cls._running[id(connections)] = cls(loop, connections, timeout_s)

    def sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            if isinstance(conn, HeaderDeadline) and conn.head_overdue(now) and not conn.transport.is_closing():
                conn.transport.close()
        if self.connections:
            self.loop.call_later(self.interval_s, self.sweep)
        else:
            del self._running[id(self.connections)]


def _uvicorn_protocol(http: str) -> type[asyncio.Protocol]:
    if http != "h11":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:  # httptools missing: uvicorn's "auto" falls back to h11 too
            if http == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def header_deadline_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                             max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, http: str = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol (``http``: "httptools", "h11", or "auto" as uvicorn: httptools when
    installed) with the header deadline; pass it as ``uvicorn.Config(http=...)``."""
    if header_timeout_s <= 0:
        raise ValueError("the HTTP header timeout must be positive")
    base = _uvicorn_protocol(http)
    return type(f"HeaderDeadline{base.__name__}", (HeaderDeadline, base),
                {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes})


def add_header_timeout_argument(parser: Any) -> None:
    parser.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="close a connection whose request line and headers are not complete this long after "
                             "it opened or its next request began (slow or half-sent headers)")


def keep_alive_timeout_s() -> float:
    """uvicorn's keep-alive timeout: $VLLM_HTTP_TIMEOUT_KEEP_ALIVE (as vLLM), else 5 s."""
    text = os.environ.get(KEEP_ALIVE_ENV)
    if not text:
        return DEFAULT_KEEP_ALIVE_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{KEEP_ALIVE_ENV} must be a number of seconds, not {text!r}") from None
    if value <= 0:
        raise ValueError(f"{KEEP_ALIVE_ENV} must be positive")
    return value


def uvicorn_connection_settings(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that bound idle and half-sent connections."""
    return {"http": header_deadline_protocol(header_timeout_s), "timeout_keep_alive": keep_alive_timeout_s(),
            "h11_max_incomplete_event_size": DEFAULT_MAX_HEADER_BYTES}
