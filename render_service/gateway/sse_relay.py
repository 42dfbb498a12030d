"""A response's engine streams relayed to the client as OpenAI SSE, where the engine's bytes arrive.

Per engine event the gateway decodes the event, derenders it and writes SSE bytes to the client. Done in a
task, every event also costs a wake-up and the resumption of each frame between the engine socket and the
client write, which measured as the larger share of the gateway's CPU per streamed token
(bench/gateway_overhead.py). So after the first events (awaited, so that a failure before them is still an
HTTP error with its status) the rest is pushed (``merged.MergedStreams``): the engine connection's data
callback runs the derender and the ASGI ``send``. ``send`` is driven in place (``start_send``): it returns
without waiting unless the client has fallen behind; only then does a task finish the write, and the engine
reads pause until the client has caught up, so a slow client holds back its own engine streams and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, cast

from starlette.types import Message, Receive, Scope, Send

from render_service.gateway import metrics
from render_service.gateway.engine_client import EngineRejected
from render_service.gateway.flow import EngineCall, Gateway
from render_service.gateway.merged import MergedStreams
from render_service.gateway.responses import ChatResponder, CompletionResponder, sse
from render_service.http.errors import ApiError, error_body
from render_service.wire.protocol import GenerateStreamChoice

logger = logging.getLogger("render_service.gateway.sse_relay")

DONE = b"data: [DONE]\n\n"
# What Starlette's StreamingResponse sends for these arguments, built once instead of per request.
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
               (b"content-type", b"text/event-stream; charset=utf-8")]

def start_send(send: Send, message: Message) -> Coroutine[Any, Any, None] | None:
    """Run ``send(message)`` in place up to its first wait: None if it finished without one (uvicorn writes
    to its transport and returns unless its flow control holds the write back), else a coroutine that
    finishes it, to be awaited by a task."""
    coro = cast(Coroutine[Any, Any, None], send(message))  # an ASGI server's send is an async function
    try:
        waited = coro.send(None)
    except StopIteration:
        return None
    return _finish_send(coro, waited)


async def _finish_send(coro: Coroutine[Any, Any, None], waited: Any) -> None:
    # What a task does for a coroutine: wait for the future it yielded, then resume it, which reads the
    # future's result (or exception) itself. A yielded future is flagged as blocking until its waiter
    # takes it (a task clears the flag); awaiting it again needs the flag cleared the same way.
    while True:
        if waited is not None:  # a bare yield (asyncio.sleep(0)) yields None
            waited._asyncio_future_blocking = False
            try:
                await waited
            except asyncio.CancelledError:
                if not waited.cancelled():  # this task was cancelled, not the future the send waits on
                    coro.close()
                    raise
            except Exception:
                pass  # the coroutine gets it from the future below
        try:
            waited = coro.send(None)
        except StopIteration:
            return


class SseRelay:
    """The ASGI response of a streamed request. The task that runs it only watches the client; the events are
    derendered and written by the engine connections' data callbacks (``MergedStreams``)."""

    status_code = 200
    media_type = "text/event-stream"

    def __init__(self, gateway: Gateway, call: EngineCall, streams: MergedStreams,
                 responder: ChatResponder | CompletionResponder) -> None:
        self.gateway = gateway
        self.call = call
        self.streams = streams
        self.responder = responder
        self.held = b""  # once every choice has finished: the rest goes out in one write, with [DONE]
        self.complete = False  # the last write is out (or handed to the drain), or the client is gone
        self.pending: list[Message] = []  # writes queued behind a send that is waiting for the client
        self.draining: asyncio.Task[None] | None = None
        self.finishing: asyncio.Task[None] | None = None  # the last write, waiting for before_last_write
        self._send: Send | None = None
        self._watcher: asyncio.Task[Any] | None = None
        self._watching = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        self._watcher = asyncio.current_task()
        await send({"type": "http.response.start", "status": self.status_code, "headers": list(SSE_HEADERS)})
        self.streams.start(self.on_choice, self.on_items, self.on_over)
        try:
            # uvicorn answers http.disconnect once the response is complete, or when the client goes away;
            # a server that keeps receive() open after the response is woken by _wake_watcher.
            while not self.complete:
                self._watching = True
                try:
                    message = await receive()
                finally:
                    self._watching = False
                if message["type"] == "http.disconnect":
                    break
        except asyncio.CancelledError:
            if not self.complete:
                raise  # cancelled from outside (shutdown)
            if self._watcher is not None and hasattr(self._watcher, "uncancel"):  # ours, from _wake_watcher
                self._watcher.uncancel()
        finally:
            if not self.complete:  # the client went away mid-stream, or shutdown
                self._client_gone()
            if self.finishing is not None:
                await asyncio.gather(self.finishing, return_exceptions=True)
            if self.draining is not None:
                await asyncio.gather(self.draining, return_exceptions=True)

    # ------------------------------------------------------------------------ engine callbacks

    def on_choice(self, prompt_index: int, choice: GenerateStreamChoice) -> None:
        """One choice event (the per-token case): derendered and written (or held, once every choice finished)."""
        if self.complete:
            return
        try:
            self._emit(self.responder.stream_events(prompt_index, choice))
        except Exception:
            self._failed()

    def on_items(self, items: list[tuple[int, GenerateStreamChoice]]) -> None:
        """The choice events of one engine read, as ``on_choice`` (several events of a choice derendered as one)."""
        if self.complete:
            return
        try:
            self._emit(self.responder.stream_batch(items))
        except Exception:
            self._failed()

    def _emit(self, data: bytes) -> None:
        if self.held or self.responder.all_done:  # every choice finished: the rest goes out with [DONE]
            self.held += data
        elif data:
            self._write(data, True)

    def _failed(self) -> None:
        logger.exception("stream %s failed in the gateway", self.responder.response_id)
        self.gateway.abort_soon(self.call)
        self.streams.close()
        self._finish(ApiError("the gateway failed mid-stream", 500))

    def on_over(self, error: Exception | None) -> None:
        """Every engine stream ended (None), or one broke (EngineStreamBroken), which closed the others."""
        if self.complete:
            return
        if error is None:
            self._finish()
            return
        # Past the first event the status line is gone: an OpenAI-style error object, then [DONE].
        if isinstance(error, EngineRejected):  # the engine refused the request: its error, as it said it
            logger.info("stream %s refused by the engine after its first event: %s", self.responder.response_id,
                        error.message())
            self._finish(ApiError(error.message(), error.status, error.param()))
            return
        self.gateway.stats.stream_errors += 1
        metrics.STREAM_ERRORS.inc()
        logger.warning("stream %s failed after its first event: %s", self.responder.response_id, error)
        self._finish(ApiError(f"engine failed mid-stream: {error}", 502, type="BadGatewayError"))

    # ------------------------------------------------------------------------------ writing

    def _finish(self, error: ApiError | None = None) -> None:
        """The last write: what was held, usage (or the error event), [DONE], and the body's end."""
        self.complete = True
        data = self.held
        final_bytes = getattr(self.responder, "final_bytes", None)
        if final_bytes is not None:  # Responses and Messages end their streams their own way (no [DONE])
            try:
                data += final_bytes(error)
            except Exception:
                logger.exception("the closing events of stream %s failed", self.responder.response_id)
        elif error is None:
            usage = self.responder.usage_chunk()
            if usage is not None:
                data += sse(usage)
        else:
            data += b"data: " + error_body(error) + b"\n\n"
        if final_bytes is None:
            data += DONE
        before = getattr(self.responder, "before_last_write", None)
        waiting = before() if before is not None else None
        if waiting is not None:  # e.g. a stored response: its last event goes out once the store has it
            self.finishing = asyncio.get_running_loop().create_task(self._last_write_after(waiting, data))
            return
        self._last_write(data)

    async def _last_write_after(self, waiting: Awaitable[Any], data: bytes) -> None:
        try:
            await waiting
        except Exception:
            logger.exception("stream %s: the wait before its last event failed", self.responder.response_id)
        self._last_write(data)

    def _last_write(self, data: bytes) -> None:
        try:
            self._write(data, False)
        except Exception:  # nothing more can reach this client
            logger.exception("the last write of stream %s failed", self.responder.response_id)
        self._wake_watcher()

    def _write(self, data: bytes, more: bool) -> None:
        message: Message = {"type": "http.response.body", "body": data, "more_body": more}
        if self.draining is not None:
            self.pending.append(message)
            return
        assert self._send is not None  # writes start once __call__ has the send
        waiting = start_send(self._send, message)
        if waiting is not None:  # the client is behind: stop reading the engine until it has caught up
            self.gateway.stats.slow_client_waits += 1
            metrics.SLOW_CLIENT_WAITS.inc()
            self.streams.pause()
            self.draining = asyncio.get_running_loop().create_task(self._drain(waiting))

    async def _drain(self, waiting: Coroutine[Any, Any, None]) -> None:
        try:
            await waiting
            while self.pending and self._send is not None:
                await self._send(self.pending.pop(0))
        except Exception:
            # The write failed: nothing more can reach this client. Stop its engine stream, end the response.
            logger.warning("stream %s: write to the client failed", self.responder.response_id, exc_info=True)
            if not self.complete:
                self.complete = True
                self.gateway.abort_soon(self.call)
                self.streams.close()
            self._wake_watcher()
            return
        finally:
            self.draining = None
        if not self.complete:
            self.streams.resume()

    def _client_gone(self) -> None:
        self.complete = True
        self.gateway.abort_soon(self.call)
        self.streams.close()
        if self.draining is not None:
            self.draining.cancel()

    def _wake_watcher(self) -> None:
        if self._watching and self._watcher is not None:
            self._watcher.cancel()
