"""HTTP calls to tokens-only engines: /inference/v1/generate (plain and SSE) and abort_requests.

Generate calls go over ``http1.Http1Pool`` (keep-alive; see there for why not httpx on the per-token
path), aborts over one shared ``httpx.AsyncClient``; both are created lazily in the serving process
(pre-forked workers must not share connections). Failures are sorted by what the flow can do about them:

* ``EngineUnavailable``: connection refused/reset, a 5xx, or a stream that ended before its first
  event. Nothing reached the client yet, so another replica may be tried.
* ``EngineRejected``: a 4xx; the engine's error body goes to the client with the same status.
* ``EngineStreamBroken``: the stream failed after events were delivered; only an error event is left.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import httpx
import msgspec

from render_service.gateway.http1 import Http1Pool, HttpError
from render_service.protocol import GenerateResponse, GenerateStreamResponse

logger = logging.getLogger("render_service.gateway.engine_client")

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
JSON_HEADERS = {"content-type": "application/json"}

_decode_response = msgspec.json.Decoder(GenerateResponse).decode
_decode_chunk = msgspec.json.Decoder(GenerateStreamResponse).decode


class EngineUnavailable(Exception):
    """Retryable: the engine refused or died before answering anything."""


class EngineRejected(Exception):
    """The engine answered 4xx: the client's request is wrong for it."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body

    def message(self) -> str:
        try:
            return str(msgspec.json.decode(self.body)["error"]["message"])
        except Exception:  # not the error envelope: pass the text on
            return self.body.decode(errors="replace")[:2000] or f"engine answered {self.status}"

    def param(self) -> str | None:
        try:
            value = msgspec.json.decode(self.body)["error"].get("param")
            return value if isinstance(value, str) else None
        except Exception:
            return None


class EngineStreamBroken(Exception):
    """The stream failed after events reached the caller."""


class EngineClient:
    """Engine calls: generate (plain and streamed) on the lean HTTP/1.1 pool, aborts on httpx."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float | None = 600.0) -> None:
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=60.0, pool=60.0)
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._pool: Http1Pool | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        return self._client

    @property
    def pool(self) -> Http1Pool:
        if self._pool is None:
            self._pool = Http1Pool(self._connect_timeout_s, self._read_timeout_s)
        return self._pool

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def generate(self, base_url: str, body: bytes, request_id: str) -> GenerateResponse:
        """Non-streaming generate (the prefill hop)."""
        try:
            response = await self.pool.post(base_url + GENERATE_PATH, body,
                                            {**JSON_HEADERS, "x-request-id": request_id})
            content = await response.read()
        except HttpError as exc:
            raise EngineUnavailable(f"{base_url}: {exc}") from None
        _check_status(base_url, response.status, content)
        try:
            return _decode_response(content)
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(f"{base_url}: unreadable generate response: {exc}") from None

    async def stream(self, base_url: str, body: bytes, request_id: str
                     ) -> AsyncIterator[list[GenerateStreamResponse]]:
        """Streaming generate: yields the engine's events until [DONE], as one list per socket read (several
        when the engine got ahead of us). Closing the generator early closes the connection, which the
        engine takes as an abort."""
        headers = {**JSON_HEADERS, "x-request-id": request_id, "accept": "text/event-stream"}
        delivered = False
        response = None
        try:
            response = await self.pool.post(base_url + GENERATE_PATH, body, headers)
            if response.status != 200:
                _check_status(base_url, response.status, await response.read())
            events = SseEvents()
            done = False
            async for chunks in response.iter_chunk_lists():
                batch = []
                for chunk in chunks:
                    # The usual chunk is one whole event with one data line, clean JSON: decoded here
                    # without a call per event (the path every streamed token takes).
                    if not events.buffer and chunk.startswith(b"data: {") and chunk.endswith(b"}\n\n") \
                            and not chunk.startswith(b'data: {"error"') and chunk.find(b"\n") == len(chunk) - 2:
                        try:
                            batch.append(_decode_chunk(chunk[6:-2]))
                            continue
                        except msgspec.DecodeError:
                            pass  # the general path below says what is wrong
                    for data in events.feed(chunk):
                        done = _engine_event(data, batch, base_url, delivered) or done
                if batch:
                    delivered = True
                    yield batch
            batch = []
            for data in events.flush():
                done = _engine_event(data, batch, base_url, delivered) or done
            if batch:
                delivered = True
                yield batch
            if done:  # read on to the end of the body: only then is the connection reused
                return
        except HttpError as exc:
            if delivered:
                raise EngineStreamBroken(f"engine stream from {base_url} broke: {exc}") from None
            raise EngineUnavailable(f"{base_url}: {exc}") from None
        finally:
            if response is not None:
                response.close()  # no-op once the body was read to its end
        if delivered:
            raise EngineStreamBroken(f"engine stream from {base_url} ended without [DONE]")
        raise EngineUnavailable(f"{base_url}: stream ended before its first event")

    async def abort(self, base_url: str, request_ids: list[str]) -> None:
        """Best effort: the engine also aborts when our connection closes."""
        body = msgspec.json.encode({"request_ids": request_ids})
        try:
            await self.client.post(base_url + ABORT_PATH, content=body, headers=JSON_HEADERS, timeout=5.0)
        except httpx.HTTPError as exc:
            logger.info("abort on %s failed: %s", base_url, exc)


def _check_status(base_url: str, status: int, body: bytes) -> None:
    if status == 200:
        return
    if 400 <= status < 500 and status not in (408, 429):
        raise EngineRejected(status, body)
    raise EngineUnavailable(f"{base_url}: HTTP {status}: {body[:300].decode(errors='replace')}")


def _engine_event(data: bytes, batch: list[GenerateStreamResponse], base_url: str, delivered: bool) -> bool:
    """Decode one SSE data payload into ``batch``; True for [DONE]. An error event is retryable until an
    event has reached the caller (events of the same read have not), a broken stream after."""
    if data == b"[DONE]":
        return True
    if data.startswith(b'{"error"'):
        error = EngineRejected(500, data).message()
        if delivered:
            raise EngineStreamBroken(error)
        raise EngineUnavailable(f"{base_url}: {error}")
    try:
        batch.append(_decode_chunk(data))
    except msgspec.DecodeError as exc:
        raise EngineStreamBroken(f"unreadable engine event: {exc}") from None
    return False


class SseEvents:
    """The data of each SSE event, fed the body's pieces as they arrive (engines send one data line per
    event; an event split across pieces is buffered until its blank line)."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, piece: bytes) -> list[bytes]:
        # The usual piece is one whole event, one data line: no buffering, no splitting.
        if not self.buffer and piece.startswith(b"data:") and piece.find(b"\n") == len(piece) - 2 \
                and piece.endswith(b"\n\n"):
            return [piece[5:-2].strip()]
        buffer = self.buffer + piece
        out = []
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        self.buffer = buffer
        return out

    def flush(self) -> list[bytes]:
        """The end of the body: an event that lacked its blank line."""
        rest, self.buffer = self.buffer.strip(), b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


def request_body(payload: Any) -> bytes:
    return msgspec.json.encode(payload)
