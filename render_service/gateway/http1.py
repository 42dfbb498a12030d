"""A lean HTTP/1.1 keep-alive client on asyncio streams, for the engine hops on the per-token hot path.

Why not httpx here: measured on the gateway (bench/gateway_overhead.py), httpx/httpcore/anyio spent
about 60% of the gateway's CPU per streamed token (per-chunk timeout scopes, h11 events, sniffio
lookups). Reading a chunked body off an ``asyncio.StreamReader`` costs a few microseconds per chunk.
This speaks exactly what the engines need: POST with a JSON body, a status line and headers back,
then a Content-Length or chunked body, with connections kept per (scheme, host, port) and reused.

A pooled connection the server closed while idle fails on first use; the request is then sent once
more on a fresh connection (the server never saw it, so the retry is safe).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import defaultdict
from typing import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_IDLE_PER_HOST = 256
# uvicorn closes idle keep-alive connections after 5 s (vLLM's engine runs on it too): reuse only younger ones.
IDLE_REUSE_S = 4.0


class HttpError(Exception):
    """Connection, protocol or timeout failure (``sent`` tells whether a response had started)."""

    def __init__(self, message: str, started: bool = False):
        super().__init__(message)
        self.started = started


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already torn down
            pass


class Response:
    """Status and headers read; the body is read with ``read()`` or ``iter_chunks()``, exactly once."""

    def __init__(self, pool: "Http1Pool", key: tuple, conn: _Conn, status: int, headers: dict[str, str]):
        self._pool = pool
        self._key = key
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._length = int(length) if length is not None and length.isdigit() else None
        self._keep = headers.get("connection", "").lower() != "close" and (self._chunked or self._length is not None)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        reader = conn.reader
        try:
            if self._chunked:
                async for data in _dechunk(reader):
                    yield data
            elif self._length is not None:
                if self._length:
                    yield await reader.readexactly(self._length)
            else:
                while True:  # body until the server closes
                    data = await reader.read(65536)
                    if not data:
                        break
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as exc:
            self.close()
            raise HttpError(f"response body broken: {type(exc).__name__}: {exc}", started=True) from None
        # The whole body was read: the connection can serve the next request.
        self._conn = None
        if self._keep:
            self._pool._release(self._key, conn)
        else:
            conn.close()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    def close(self) -> None:
        """Abandon the body: the connection cannot be reused (the engine sees the close as an abort)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


async def _dechunk(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a chunked body. Parsed from one local buffer: one ``read`` brings in every chunk the
    socket holds (an engine event is one chunk), instead of two StreamReader calls per chunk."""
    buf = b""
    pos = 0
    while True:
        end = buf.find(b"\r\n", pos)
        if end >= 0:
            size = int(buf[pos:end].split(b";", 1)[0].strip(), 16)
            start = end + 2
            if size == 0:
                # trailers (if any), then the blank line that ends the body
                while (tail := buf.find(b"\r\n", start)) != start:
                    if tail < 0:
                        buf = buf[start:] + await reader.readuntil(b"\r\n")
                        start = 0
                    else:
                        start = tail + 2
                if len(buf) > start + 2:
                    raise ValueError("bytes after the end of a chunked body")
                return
            stop = start + size
            if len(buf) < stop + 2:  # a chunk larger than what arrived: read exactly the rest
                buf = buf[pos:] + await reader.readexactly(stop + 2 - len(buf))
                start, stop, pos = start - pos, stop - pos, 0
            if buf[stop:stop + 2] != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
            yield buf[start:stop]
            pos = stop + 2
            continue
        if len(buf) - pos > MAX_HEADER_BYTES:
            raise ValueError("chunk size line too long")
        data = await reader.read(65536)
        if not data:
            raise asyncio.IncompleteReadError(buf[pos:], None)
        buf = buf[pos:] + data if pos < len(buf) else data
        pos = 0


class Http1Pool:
    def __init__(self, connect_timeout_s: float = 5.0, header_timeout_s: float | None = 600.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.header_timeout_s = header_timeout_s
        self._idle: dict[tuple, list[_Conn]] = defaultdict(list)
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        parts = urlsplit(url)
        https = parts.scheme == "https"
        host = parts.hostname or "localhost"
        port = parts.port or (443 if https else 80)
        key = (https, host, port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"POST {path} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for attempt in range(2):
            # the retry takes a fresh connection: other idle ones may be stale too
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(https, host, port)
            try:
                conn.writer.write(request)
                status, response_headers = await self._read_head(conn.reader)
                return Response(self, key, conn, status, response_headers)
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # a keep-alive connection the server had closed: the request never arrived
                raise HttpError(f"{type(exc).__name__}: {exc}") from None
            except asyncio.TimeoutError:
                conn.close()
                raise HttpError("timed out waiting for the response headers") from None
            except (ValueError, asyncio.LimitOverrunError) as exc:
                conn.close()
                raise HttpError(f"malformed response: {exc}") from None
        raise HttpError("unreachable")

    async def _connect(self, https: bool, host: str, port: int) -> _Conn:
        context = None
        if https:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=context, limit=MAX_HEADER_BYTES),
                self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise HttpError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}") from None
        return _Conn(reader, writer)

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        if self.header_timeout_s is None:
            raw = await reader.readuntil(b"\r\n\r\n")
        else:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout_s)
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

    def _take_idle(self, key: tuple) -> _Conn | None:
        """The most recently used idle connection that the server cannot have timed out yet."""
        idle = self._idle[key]
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.reader.at_eof() and now - conn.idle_since < IDLE_REUSE_S:
                return conn
            conn.close()
        return None

    def _release(self, key: tuple, conn: _Conn) -> None:
        idle = self._idle[key]
        if len(idle) < MAX_IDLE_PER_HOST and not conn.reader.at_eof():
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
