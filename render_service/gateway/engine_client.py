"""HTTP calls to tokens-only engines: /inference/v1/generate (plain and SSE) and abort_requests.

Generate calls go over ``http1.Http1Pool`` (keep-alive; see there for why not httpx on the per-token
path), aborts over one shared ``httpx.AsyncClient``; both are created lazily in the serving process
(pre-forked workers must not share connections). Failures are sorted by what the flow can do about them:

* ``EngineUnavailable``: connection refused/reset, a 5xx, or a stream that ended before its first
  event. Nothing reached the client yet, so another replica may be tried.
* ``EngineRejected``: a 4xx, or an error event with a 4xx code inside a 200 stream (vLLM's engine refuses
  some requests that way); the engine's error goes to the client with the same status, never retried.
* ``EngineStreamBroken``: the stream failed after events were delivered; only an error event is left.

With an engine API key, every call carries ``Authorization: Bearer KEY``. An engine that refuses the
gateway's credentials (401/403) is the gateway's misconfiguration, not the client's: it is an
``EngineUnavailable`` naming the flag to set, never the engine's 401 handed to a client whose own key is fine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import msgspec

from render_service.gateway.http1 import Http1Pool, HttpError, Response
from render_service.wire.protocol import GenerateResponse, GenerateStreamResponse
from splitserve_common.tenants import TENANT_HEADER

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

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float | None = 600.0,
                 api_key: str | None = None) -> None:
        self._headers = {**JSON_HEADERS, **({"authorization": f"Bearer {api_key}"} if api_key else {})}
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

    async def generate(self, base_url: str, body: bytes, request_id: str, tenant: str | None = None
                       ) -> GenerateResponse:
        """Non-streaming generate (the prefill hop)."""
        headers = {**self._headers, "x-request-id": request_id}
        if tenant:
            headers[TENANT_HEADER] = tenant
        try:
            response = await self.pool.post(base_url + GENERATE_PATH, body, headers)
            content = await response.read()
        except HttpError as exc:
            raise EngineUnavailable(f"{base_url}: {exc}") from None
        _check_status(base_url, response.status, content)
        try:
            return _decode_response(content)
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(f"{base_url}: unreadable generate response: {exc}") from None

    async def open_stream(self, base_url: str, body: bytes, request_id: str, tenant: str | None = None
                          ) -> EngineEvents:
        """Start a streaming generate: the status is checked, the events are read from what is returned."""
        headers = {**self._headers, "x-request-id": request_id, "accept": "text/event-stream"}
        if tenant:  # the engine charges its per-client budgets to the tenant the gateway vouches for
            headers[TENANT_HEADER] = tenant
        try:
            response = await self.pool.post(base_url + GENERATE_PATH, body, headers)
            if response.status != 200:
                _check_status(base_url, response.status, await response.read())
        except HttpError as exc:
            raise EngineUnavailable(f"{base_url}: {exc}") from None
        return EngineEvents(base_url, response)

    async def abort(self, base_url: str, request_ids: list[str]) -> None:
        """Best effort: the engine also aborts when our connection closes."""
        body = msgspec.json.encode({"request_ids": request_ids})
        try:
            response = await self.client.post(base_url + ABORT_PATH, content=body, headers=self._headers,
                                              timeout=5.0)
        except httpx.HTTPError as exc:
            logger.info("abort on %s failed: %s", base_url, exc)
            return
        if response.status_code in (401, 403):  # every abort would fail the same way: say why
            logger.warning("abort on %s refused (HTTP %d): the gateway's --engine-api-key is not a key of that "
                           "engine", base_url, response.status_code)


class EngineEvents:
    """The events of one streaming generate call, as one list per socket read (several when the engine got
    ahead of us), pulled (``next_batch``) or pushed (``push``), or pulled first and pushed after.

    Failures follow the module's sorting: until an event has been delivered, ``EngineUnavailable`` (the
    flow may retry elsewhere); after, ``EngineStreamBroken``. The stream must end with [DONE]; the
    connection goes back to the pool once the body has been read to its end.
    """

    def __init__(self, base_url: str, response: Response) -> None:
        self.base_url = base_url
        self._response = response
        self._sse = SseEvents()
        self.delivered = False  # an event has reached the caller
        self.done = False  # [DONE] was read

    def _decode(self, chunks: list[bytes]) -> list[GenerateStreamResponse]:
        batch: list[GenerateStreamResponse] = []
        for chunk in chunks:
            # The usual chunk is one whole event with one data line, clean JSON: decoded here without a call
            # per event (the path every streamed token takes).
            if not self._sse.buffer and chunk.startswith(b"data: {") and chunk.endswith(b"}\n\n") \
                    and not chunk.startswith(b'data: {"error"') and chunk.find(b"\n") == len(chunk) - 2:
                try:
                    batch.append(_decode_chunk(chunk[6:-2]))
                    continue
                except msgspec.DecodeError:
                    pass  # the general path below says what is wrong
            for data in self._sse.feed(chunk):
                if _engine_event(data, batch, self.base_url, self.delivered):
                    self.done = True
        return batch

    def _ended(self) -> list[GenerateStreamResponse]:
        """The body's end: an event that lacked its blank line, then the check for [DONE]."""
        batch: list[GenerateStreamResponse] = []
        for data in self._sse.flush():
            if _engine_event(data, batch, self.base_url, self.delivered):
                self.done = True
        if not self.done and not batch:
            raise self._broken("ended without [DONE]" if self.delivered else "stream ended before its first event")
        return batch

    def _broken(self, what: str) -> Exception:
        if self.delivered:
            return EngineStreamBroken(f"engine stream from {self.base_url} {what}")
        return EngineUnavailable(f"{self.base_url}: {what}")

    async def next_batch(self) -> list[GenerateStreamResponse] | None:
        """The events of the next read that brought any; None after [DONE] and the body's end."""
        try:
            while (chunks := await self._response.next_chunks()) is not None:
                batch = self._decode(chunks)
                if batch:
                    self.delivered = True
                    return batch
        except HttpError as exc:
            raise self._broken(f"broke: {exc}") from None
        except BaseException:
            self.close()
            raise
        if self.done:
            return None
        batch = self._ended()
        self.delivered = True
        return batch

    def push(self, on_batch: Callable[[list[GenerateStreamResponse]], None],
             on_end: Callable[[Exception | None], None]) -> None:
        """From now on, each read's events go to ``on_batch`` in the connection's data callback; ``on_end``
        follows once, with None after [DONE] or the failure (EngineStreamBroken / EngineUnavailable /
        EngineRejected). A
        ``close()`` from inside ``on_batch`` stops both."""

        def chunks(pieces: list[bytes]) -> None:
            try:
                batch = self._decode(pieces)
            except (EngineStreamBroken, EngineUnavailable, EngineRejected) as exc:
                self.close()
                on_end(exc)
                return
            if batch:
                self.delivered = True
                on_batch(batch)

        def end(error: HttpError | None) -> None:
            if error is not None:
                on_end(self._broken(f"broke: {error}"))
                return
            if not self.done:
                try:
                    batch = self._ended()
                except (EngineStreamBroken, EngineUnavailable, EngineRejected) as exc:
                    on_end(exc)
                    return
                if batch:
                    self.delivered = True
                    on_batch(batch)
                if not self.done:  # an unterminated last event, but no [DONE] after it
                    on_end(self._broken("ended without [DONE]"))
                    return
            on_end(None)

        self._response.push_chunks(chunks, end)

    def pause(self) -> None:
        self._response.pause_reading()

    def resume(self) -> None:
        self._response.resume_reading()

    def close(self) -> None:
        """Stop reading; unless the body was read to its end, the connection closes (the engine aborts)."""
        self._response.close()


def _check_status(base_url: str, status: int, body: bytes) -> None:
    if status == 200:
        return
    if status in (401, 403):
        raise EngineUnavailable(f"{base_url} refused the gateway's credentials (HTTP {status}): start the gateway "
                                "with --engine-api-key (or $SPLITSERVE_ENGINE_API_KEY) set to a key the engines "
                                "take with --api-key")
    if _is_refusal(status):
        raise EngineRejected(status, body)
    raise EngineUnavailable(f"{base_url}: HTTP {status}: {body[:300].decode(errors='replace')}")


def refusal_status(data: bytes) -> int | None:
    """The 4xx of an error event that refuses the request (vLLM's engine answers a prompt too long, or
    structured outputs it cannot apply, with HTTP 200 and ``data: {"error": {..., "code": 400}}``); None
    for any other error event (the engine failed: a 5xx, or no code)."""
    try:
        error = msgspec.json.decode(data)["error"]
        code = error.get("code") if isinstance(error, dict) else None
    except Exception:
        return None
    if isinstance(code, int) and not isinstance(code, bool) and _is_refusal(code):
        return code
    return None


def _is_refusal(status: int) -> bool:
    """A 4xx that is the client's: answered to it, and the replica is not held at fault (408 is retried).
    A 429 is a budget of the client's tenant on that engine (compile caps): passed on, so one tenant over
    its budget never puts a replica in cooldown for everybody."""
    return 400 <= status < 500 and status != 408


def _engine_event(data: bytes, batch: list[GenerateStreamResponse], base_url: str, delivered: bool) -> bool:
    """Decode one SSE data payload into ``batch``; True for [DONE]. An error event with a 4xx code is the
    client's error, before or after the first event (``EngineRejected``: never retried). Any other error
    event is retryable until an event has reached the caller (events of the same read have not), a broken
    stream after."""
    if data == b"[DONE]":
        return True
    if data.startswith(b'{"error"'):
        status = refusal_status(data)
        if status is not None:
            raise EngineRejected(status, data)
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
