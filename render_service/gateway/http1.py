"""A lean HTTP/1.1 keep-alive client on an asyncio protocol, for the engine hops on the per-token hot path.

Why not httpx here: measured on the gateway (bench/gateway_overhead.py), httpx/httpcore/anyio spent
about 60% of the gateway's CPU per streamed token (per-chunk timeout scopes, h11 events, sniffio
lookups). Why not asyncio streams either: a StreamReader adds several Python calls per arrival, and
on the per-token path every call counts; here one read takes whatever the socket delivered.
This speaks exactly what the engines need: POST with a JSON body, a status line and headers back,
then a Content-Length or chunked body, with connections kept per (scheme, host, port) and reused.

A pooled connection the server closed while idle fails on first use; the request is then sent once
more on a fresh connection (the server never saw it, so the retry is safe).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
PoolKey = tuple[bool, str, int]  # (https, host, port): connections are pooled per engine
MAX_BUFFER_BYTES = 4 * 1024 * 1024  # reading from the socket pauses while this much waits unread
MAX_IDLE_PER_HOST = 256
# uvicorn closes idle keep-alive connections after 5 s (vLLM's engine runs on it too): reuse only younger ones.
IDLE_REUSE_S = 4.0


class HttpError(Exception):
    """Connection, protocol or timeout failure (``sent`` tells whether a response had started)."""

    def __init__(self, message: str, started: bool = False):
        super().__init__(message)
        self.started = started


class _Conn(asyncio.Protocol):
    """One kept-alive connection. What the socket delivers waits in ``buf`` until the response reader
    takes all of it with ``read()``: one callback and one wake-up per arrival, none of a StreamReader's
    layers (they were a good part of the per-token cost)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.eof = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        # Push mode (Response.push_chunks): what arrives goes to the sink at once, b"" once the server closed.
        self.sink: Callable[[bytes], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's

    def data_received(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)
            return
        self.buf = self.buf + data if self.buf else data
        if len(self.buf) > MAX_BUFFER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter, self.waiter = self.waiter, None  # _wake, inline: this runs once per engine event
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        if self.sink is not None:
            sink, self.sink = self.sink, None
            sink(b"")
            return
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def time_out(self) -> None:
        """A timer fired: the pending ``read()`` raises TimeoutError."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(asyncio.TimeoutError())

    async def read(self) -> bytes:
        """Everything that has arrived, waiting for something if nothing has; b"" once the server closed."""
        if not self.buf and not self.eof:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.take()

    def take(self) -> bytes:
        """Everything that has arrived (b"" if nothing has)."""
        data, self.buf = self.buf, b""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def unread(self, data: bytes) -> None:
        if data:
            self.buf = data + self.buf

    def at_eof(self) -> bool:
        return self.eof and not self.buf

    def write(self, data: bytes) -> None:
        if self.eof or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection closed by the server")
        self.transport.write(data)

    def close(self) -> None:
        self.eof = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """Status and headers read; the body is read once, pulled (``next_chunks``, ``read``) or pushed
    (``push_chunks``), or both: pulled first, then pushed from where the pulls stopped."""

    def __init__(self, pool: Http1Pool, key: PoolKey, conn: _Conn, status: int, headers: dict[str, str]):
        self._pool = pool
        self._key = key
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        # The body's framing: chunked, Content-Length (bytes still to come), or until the server closes.
        self._chunks = ChunkedDecoder() if chunked else None
        self._remaining = int(length) if not chunked and length is not None and length.isdigit() else None
        self._keep = headers.get("connection", "").lower() != "close" and (chunked or self._remaining is not None)

    @property
    def finished(self) -> bool:
        """The body was read to its end, or abandoned."""
        return self._conn is None

    def _body_pieces(self, data: bytes) -> list[bytes]:
        """What one read of the body brings: its whole chunks (chunked), its bytes (otherwise). b"" is the
        server's close, which ends only a close-delimited body. Raises ValueError on a broken body."""
        if self._chunks is not None:
            if not data:
                raise asyncio.IncompleteReadError(self._chunks.pending, None)
            return self._chunks.feed(data)
        if self._remaining is None:
            return [data] if data else []
        if not data and self._remaining:
            raise asyncio.IncompleteReadError(b"", self._remaining)
        piece = data[:self._remaining]
        self._remaining -= len(piece)
        if len(data) > len(piece):
            raise ValueError("bytes after the end of a Content-Length body")
        return [piece] if piece else []

    def _body_done(self, data: bytes) -> bool:
        if self._chunks is not None:
            return self._chunks.done
        return not data if self._remaining is None else self._remaining == 0

    async def next_chunks(self) -> list[bytes] | None:
        """The body's next chunks, as many as one socket read completed (several when the server got ahead
        of us, so that the caller handles them in one go); None after the last."""
        conn = self._conn
        if conn is None:
            return None
        try:
            if self._remaining == 0:  # an empty Content-Length body: nothing to wait for
                self._completed()
                return None
            while True:
                # conn.read(), inline: this loop turns once per engine event
                if not conn.buf and not conn.eof:
                    conn.waiter = conn.loop.create_future()
                    await conn.waiter
                data = conn.take()
                pieces = self._body_pieces(data)
                if self._body_done(data):
                    self._completed()
                    return pieces or None
                if pieces:
                    return pieces
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as exc:
            self.close()
            raise HttpError(f"response body broken: {type(exc).__name__}: {exc}", started=True) from None

    async def iter_chunk_lists(self) -> AsyncIterator[list[bytes]]:
        while (chunks := await self.next_chunks()) is not None:
            yield chunks

    def push_chunks(self, on_chunks: Callable[[list[bytes]], None],
                    on_end: Callable[[HttpError | None], None]) -> None:
        """From now on, hand the body's chunks to ``on_chunks`` in the connection's data callback, as they
        arrive: no task wakes up per event. ``on_end`` follows once: None after the last chunk (the
        connection is back in the pool by then), an HttpError if the body broke. Closing the response
        stops the calls."""
        conn = self._conn
        if conn is None:
            on_end(None)
            return

        def arrived(data: bytes) -> None:
            try:
                pieces = self._body_pieces(data)
            except (asyncio.IncompleteReadError, ValueError) as exc:
                self.close()
                on_end(HttpError(f"response body broken: {type(exc).__name__}: {exc}", started=True))
                return
            done = self._body_done(data)
            if done:
                self._completed()
            if pieces:
                on_chunks(pieces)
            if done:
                on_end(None)

        conn.sink = arrived
        if conn.buf:  # what arrived after the last pull
            arrived(conn.take())
        if conn.eof and self._conn is conn:  # the server closed before the switch: its close, delivered here
            conn.sink = None
            arrived(b"")

    def pause_reading(self) -> None:
        """Leave the body in the kernel until ``resume_reading``: the consumer cannot keep up."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.resume_reading()

    def _completed(self) -> None:
        """The whole body was read: the connection can serve the next request."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.sink = None
        if self._keep:
            self._pool._release(self._key, conn)
        else:
            conn.close()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunks in self.iter_chunk_lists() for chunk in chunks])

    def close(self) -> None:
        """Abandon the body: the connection cannot be reused (the engine sees the close as an abort)."""
        if self._conn is not None:
            self._conn.sink = None
            self._conn.close()
            self._conn = None


class ChunkedDecoder:
    """A chunked body, parsed incrementally: ``feed`` the bytes of each read, get the chunks it completed.

    One buffer and one pass per read (an engine event is one chunk; one read usually brings in one
    or more whole chunks), instead of two StreamReader calls per chunk. Raises ValueError on a
    malformed body, including bytes after its end (the connection must not be reused then).
    """

    __slots__ = ("buf", "done")

    def __init__(self) -> None:
        self.buf = b""
        self.done = False

    @property
    def pending(self) -> bytes:
        return self.buf

    def feed(self, data: bytes) -> list[bytes]:
        if self.done:
            raise ValueError("bytes after the end of a chunked body")
        if not self.buf:
            # The usual read on the per-token path: exactly one whole, non-final chunk.
            end = data.find(b"\r\n", 0, 18)
            if end > 0 and data.endswith(b"\r\n"):
                try:
                    size = int(data[:end], 16)
                except ValueError:
                    size = -1  # an extension or garbage: the general path below decides
                if size > 0 and len(data) == end + size + 4:
                    return [data[end + 2:end + 2 + size]]
        buf = self.buf + data if self.buf else data
        pos = 0
        out: list[bytes] = []
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_HEADER_BYTES:
                    raise ValueError("chunk size line too long")
                break
            size = int(buf[pos:end].split(b";", 1)[0].strip(), 16)
            if size < 0:
                raise ValueError("negative chunk size")
            start = end + 2
            if size == 0:
                # trailers (if any), then the blank line that ends the body
                while (line_end := buf.find(b"\r\n", start)) != start:
                    if line_end < 0:
                        if len(buf) - pos > MAX_HEADER_BYTES:
                            raise ValueError("trailers too long")
                        self.buf = buf[pos:]  # parsed again from the last chunk's size line
                        return out
                    start = line_end + 2
                if len(buf) > start + 2:
                    raise ValueError("bytes after the end of a chunked body")
                self.done = True
                self.buf = b""
                return out
            stop = start + size
            if len(buf) < stop + 2:  # the rest of this chunk is still to come
                break
            if buf[stop:stop + 2] != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
            out.append(buf[start:stop])
            pos = stop + 2
        self.buf = buf[pos:]
        return out


async def _head_bytes(conn: _Conn) -> bytes:
    """The status line and headers (without the blank line); what follows stays on the connection."""
    buf = b""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > MAX_HEADER_BYTES:
            raise ValueError("response head too long")
        data = await conn.read()
        if not data:
            raise asyncio.IncompleteReadError(buf, None)
        buf += data
    conn.unread(buf[end + 4:])
    return buf[:end]


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[PoolKey, str]:
    """((https, host, port), the request line and host header) of a URL: the same few engine URLs
    on every request, parsed once."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if https else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (https, host, port), f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}"


class Http1Pool:
    def __init__(self, connect_timeout_s: float = 5.0, header_timeout_s: float | None = 600.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.header_timeout_s = header_timeout_s
        self._idle: dict[PoolKey, list[_Conn]] = defaultdict(list)
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        key, request_line = _target(url)
        https, host, port = key
        head = [request_line, f"content-length: {len(body)}"]
        for k, v in headers.items():
            if "\r" in v or "\n" in v:  # callers pass header-safe values; this is the last line of defence
                raise ValueError(f"header {k} holds a CR or LF")
            head.append(f"{k}: {v}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for attempt in range(2):
            # the retry takes a fresh connection: other idle ones may be stale too
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(https, host, port)
            try:
                conn.write(request)
                status, response_headers = await self._read_head(conn)
                return Response(self, key, conn, status, response_headers)
            except asyncio.TimeoutError:  # first: since Python 3.11 it is an OSError, which may be retried
                conn.close()
                raise HttpError("timed out waiting for the response headers") from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # a keep-alive connection the server had closed: the request never arrived
                raise HttpError(f"{type(exc).__name__}: {exc}") from None
            except (ValueError, asyncio.LimitOverrunError) as exc:
                conn.close()
                raise HttpError(f"malformed response: {exc}") from None
            except BaseException:  # cancelled mid-request: the connection is in an unknown state
                conn.close()
                raise
        raise HttpError("unreachable")

    async def _connect(self, https: bool, host: str, port: int) -> _Conn:
        context = None
        if https:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            _, conn = await asyncio.wait_for(
                asyncio.get_running_loop().create_connection(_Conn, host, port, ssl=context),
                self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise HttpError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from None
        return conn

    async def _read_head(self, conn: _Conn) -> tuple[int, dict[str, str]]:
        # A timer handle on the connection: cheaper than asyncio.timeout, and than wait_for's task per request.
        timer = None if self.header_timeout_s is None else conn.loop.call_later(self.header_timeout_s, conn.time_out)
        try:
            raw = await _head_bytes(conn)
        finally:
            if timer is not None:
                timer.cancel()
        lines = raw.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return int(status), headers

    def _take_idle(self, key: PoolKey) -> _Conn | None:
        """The most recently used idle connection that the server cannot have timed out yet."""
        idle = self._idle[key]
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.at_eof() and now - conn.idle_since < IDLE_REUSE_S:
                return conn
            conn.close()
        return None

    def _release(self, key: PoolKey, conn: _Conn) -> None:
        idle = self._idle[key]
        if len(idle) < MAX_IDLE_PER_HOST and not conn.at_eof():
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
