"""HTTP calls to tokens-only engines: /inference/v1/generate (plain and SSE) and abort_requests.

One shared ``httpx.AsyncClient`` (keep-alive, created lazily in the serving process: pre-forked
workers must not share a connection pool). Failures are sorted by what the flow can do about them:

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
    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float | None = 600.0,
                 max_connections: int = 1024) -> None:
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=60.0, pool=60.0)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                    keepalive_expiry=60.0)
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def generate(self, base_url: str, body: bytes, request_id: str) -> GenerateResponse:
        """Non-streaming generate (the prefill hop)."""
        headers = {**JSON_HEADERS, "x-request-id": request_id}
        try:
            response = await self.client.post(base_url + GENERATE_PATH, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{base_url}: {type(exc).__name__}: {exc}") from None
        _check_status(base_url, response.status_code, response.content)
        try:
            return _decode_response(response.content)
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(f"{base_url}: unreadable generate response: {exc}") from None

    async def stream(self, base_url: str, body: bytes, request_id: str) -> AsyncIterator[GenerateStreamResponse]:
        """Streaming generate: yields engine chunks until [DONE]. Closing the generator closes the connection,
        which the engine takes as an abort."""
        headers = {**JSON_HEADERS, "x-request-id": request_id, "accept": "text/event-stream"}
        delivered = False
        try:
            async with self.client.stream("POST", base_url + GENERATE_PATH, content=body, headers=headers) as response:
                if response.status_code != 200:
                    _check_status(base_url, response.status_code, await response.aread())
                async for data in _sse_data(response.aiter_raw()):
                    if data == b"[DONE]":
                        return
                    if data.startswith(b'{"error"'):
                        error = EngineRejected(500, data).message()
                        if delivered:
                            raise EngineStreamBroken(error)
                        raise EngineUnavailable(f"{base_url}: {error}")
                    try:
                        chunk = _decode_chunk(data)
                    except msgspec.DecodeError as exc:
                        raise EngineStreamBroken(f"unreadable engine event: {exc}") from None
                    delivered = True
                    yield chunk
        except httpx.HTTPError as exc:
            if delivered:
                raise EngineStreamBroken(f"engine stream from {base_url} broke: {type(exc).__name__}") from None
            raise EngineUnavailable(f"{base_url}: {type(exc).__name__}: {exc}") from None
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


async def _sse_data(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The data of each SSE event (events end with a blank line; one data line each, as engines send)."""
    buffer = b""
    async for piece in raw:
        buffer += piece
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    if buffer.strip().startswith(b"data:"):
        yield buffer.strip()[5:].strip()


def request_body(payload: Any) -> bytes:
    return msgspec.json.encode(payload)
