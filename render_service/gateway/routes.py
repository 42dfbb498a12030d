"""/v1/chat/completions and /v1/completions: render -> engine(s) -> derender in one call.

Render and derender are the functions the /render and /derender endpoints call, run in-process; only
the engine hops are HTTP. A streaming response starts once the engine's first event is in, so that
anything that fails before it (a 4xx from the engine, no replica left) is still an HTTP error with
its status; after that, a failure is an error event followed by [DONE]. A client that goes away
aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from render_service.errors import ApiError, bad_request, error_body
from render_service.gateway import metrics
from render_service.gateway.conversations import conversation_key
from render_service.gateway.engine_client import EngineRejected, EngineStreamBroken
from render_service.gateway.flow import EngineCall, EngineStream, Gateway, NoReplica, plan_streams
from render_service.gateway.responses import ChatResponder, CompletionResponder, sse
from render_service.gateway.sse_relay import DONE, SSE_HEADERS, SseRelay
from render_service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateStreamChoice,
    GenerateStreamResponse,
)
from render_service.render import RenderConfig, render_chat, render_completion

logger = logging.getLogger("render_service.gateway.routes")

_encode = msgspec.json.Encoder().encode

Handler = Callable[[Request], Awaitable[Response]]


def gateway_routes(gateway: Gateway, config: RenderConfig, endpoint: Callable[[str, Handler], Handler],
                   read_body: Callable[[Request], Awaitable[bytes]],
                   decode: Callable[[bytes, type], Any]) -> list[Route]:
    """The two routes, wrapped by the server's ``endpoint`` (auth, error envelope, metrics)."""

    async def chat(request: Request) -> Response:
        req = decode(await read_body(request), ChatCompletionRequest)
        _check_supported(req)
        conversation = conversation_key(req.conversation_id, request.headers)
        gen = render_chat(req, config, request_id=request.headers.get("x-request-id"))
        responder = ChatResponder(gen, req, config)
        return await respond(request, gateway, [gen], responder, bool(req.stream), conversation)

    async def completions(request: Request) -> Response:
        req = decode(await read_body(request), CompletionRequest)
        _check_supported(req)
        gens = render_completion(req, config, request_id=request.headers.get("x-request-id"))
        response_id = gens[0].request_id if len(gens) == 1 else gens[0].request_id.rsplit("-", 1)[0]
        responder = CompletionResponder(gens, req, config, response_id)
        conversation = conversation_key(req.conversation_id, request.headers)
        return await respond(request, gateway, gens, responder, bool(req.stream), conversation)

    async def status(request: Request) -> Response:
        return Response(_encode(gateway.snapshot()), media_type="application/json")

    return [
        Route("/v1/chat/completions", endpoint("chat_completions", chat), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
        Route("/gateway/status", endpoint("gateway_status", status), methods=["GET"]),
    ]


def _check_supported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.echo:
        raise bad_request("echo is not supported by the gateway", "echo")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported by the gateway", "prompt_logprobs")
    if req.kv_transfer_params is not None:
        raise bad_request("kv_transfer_params are set by the gateway, not by clients", "kv_transfer_params")


# ------------------------------------------------------------------------------------ driving


async def engine_choices(gateway: Gateway, streams: list[EngineStream], call: EngineCall,
                         span_done: Callable[[int, int, int], bool] | None
                         ) -> AsyncIterator[list[tuple[int, GenerateStreamChoice]]]:
    """Several engine calls (several prompts, or n > 1 in P/D) merged: (prompt index, engine choice event
    with the prompt's choice index), one list per engine read; a call whose choices all ended early
    (stop strings: ``span_done``, None when there are none) is closed and aborted at once."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: GenerateRequest) -> None:
        try:
            async with aclosing(gateway.events(gen, call)) as events:
                async for batch in events:
                    await queue.put((i, batch, None))
            await queue.put((i, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((i, None, exc))

    tasks = {i: asyncio.get_running_loop().create_task(pump(i, s.gen)) for i, s in enumerate(streams)}
    finished: dict[int, set[int]] = {i: set() for i in tasks}
    try:
        remaining = set(tasks)
        while remaining:
            i, batch, exc = await queue.get()
            if exc is not None:
                raise exc
            if batch is None or i not in remaining:
                remaining.discard(i)
                continue
            s = streams[i]
            items = []
            for chunk in batch:
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        finished[i].add(choice.index)
                    if s.first:
                        choice.index += s.first
                    items.append((s.prompt_index, choice))
            if items:
                yield items
            if span_done is not None and len(finished[i]) < s.count and span_done(s.prompt_index, s.first, s.count):
                gateway.abort_soon(call, s.gen.request_id)
                tasks[i].cancel()
                remaining.discard(i)
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def fold_one(gateway: Gateway, gen: GenerateRequest, call: EngineCall,
                   responder: ChatResponder | CompletionResponder) -> None:
    """A non-streamed request with one engine stream: its events are folded into the responder in the
    engine connection's data callback (as the streamed path writes them, sse_relay.py); this task wakes
    for the first event and the end only."""
    live = await gateway.open(gen, call)
    ended: asyncio.Future = asyncio.get_running_loop().create_future()
    span_done = responder.span_done if responder.stops else None
    finished: set[int] = set()

    def on_batch(batch: list[GenerateStreamResponse]) -> None:
        if ended.done():
            return
        try:
            for chunk in batch:
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        finished.add(choice.index)
                    responder.accumulate(0, choice)
            if span_done is not None and len(finished) < responder.n and span_done(0, 0, responder.n):
                gateway.abort_soon(call)  # a stop string ended every choice: the engine need not go on
                live.close()
                ended.set_result(None)
        except Exception as exc:
            live.close()
            ended.set_exception(exc)

    def on_end(error: Exception | None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        else:
            ended.set_exception(error)

    try:
        on_batch(live.first)
        if not ended.done():
            live.push(on_batch, on_end)
        await ended
    finally:
        live.close()  # nothing once the stream ended; cancelled (client gone): closes the engine connection


async def respond(request: Request, gateway: Gateway, gens: list[GenerateRequest],
                  responder: ChatResponder | CompletionResponder, stream: bool,
                  conversation: bytes | None = None) -> Response:
    gateway.stats.requests += 1
    streams = plan_streams(gens, gateway.disaggregated)
    # KV reuse across turns needs one decode sequence per turn (with n > 1, which one continues is unknown)
    call = EngineCall(conversation=conversation if gateway.disaggregated and len(streams) == 1 else None)
    if len(streams) == 1:
        if not stream:
            return await _collect(request, gateway, call, fold_one(gateway, streams[0].gen, call, responder),
                                  responder)
        # Wait for the first event before answering: errors until then keep their HTTP status.
        try:
            live = await gateway.open(streams[0].gen, call)
        except BaseException as exc:
            gateway.abort_soon(call)
            raise engine_error(exc) from None
        return SseRelay(gateway, call, live, responder)
    choices = engine_choices(gateway, streams, call, responder.span_done if responder.stops else None)
    if not stream:
        return await _collect(request, gateway, call, _fold(choices, responder), responder)
    try:
        first = await choices.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as exc:
        gateway.abort_soon(call)
        await choices.aclose()
        raise engine_error(exc) from None
    return GatewayStream(_sse_events(gateway, choices, first, responder), gateway, call, choices)


def engine_error(exc: BaseException) -> BaseException:
    """A failure before anything reached the client, as the HTTP error it is (others unchanged)."""
    if isinstance(exc, EngineRejected):
        return ApiError(exc.message(), exc.status, exc.param())
    if isinstance(exc, NoReplica):
        return ApiError(str(exc), 503, type="ServiceUnavailableError")
    if isinstance(exc, EngineStreamBroken):
        return ApiError(str(exc), 502, type="BadGatewayError")
    return exc


async def _fold(choices: AsyncIterator[list[tuple[int, GenerateStreamChoice]]],
                responder: ChatResponder | CompletionResponder) -> None:
    async with aclosing(choices):
        async for batch in choices:
            for prompt_index, choice in batch:
                responder.accumulate(prompt_index, choice)


async def _collect(request: Request, gateway: Gateway, call: EngineCall, fold: Coroutine[Any, Any, None],
                   responder: ChatResponder | CompletionResponder) -> Response:
    work = asyncio.ensure_future(fold)
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and not client_went_away(gone):
            await asyncio.wait({work})  # the watcher failed without seeing the client go: finish unwatched
    finally:
        if not work.done():
            gateway.abort_soon(call)
            work.cancel()
        gone.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    # 499 only for a client that went away (nobody reads it; it is for the access log). A fold cancelled
    # by anything else is our failure and must not be blamed on a client that is still waiting.
    if client_went_away(gone) and work.cancelled():
        return Response(error_body(ApiError("client disconnected", 499)), status_code=499,
                        media_type="application/json")
    if work.cancelled():
        logger.error("engine calls of %s were cancelled with the client still there", responder.response_id)
        raise ApiError("the engine call was cancelled", 502, type="BadGatewayError")
    exc = work.exception()
    if exc is not None:
        if isinstance(exc, EngineStreamBroken):
            gateway.stats.stream_errors += 1
            metrics.STREAM_ERRORS.inc()
        raise engine_error(exc)
    return Response(_encode(responder.response()), media_type="application/json")


async def _sse_events(gateway: Gateway, choices: AsyncIterator[list[tuple[int, GenerateStreamChoice]]],
                      first: list[tuple[int, GenerateStreamChoice]] | None,
                      responder: ChatResponder | CompletionResponder) -> AsyncIterator[bytes]:
    # One client write per engine read (its events' chunks joined), none for a read with nothing to send;
    # once every choice has finished, the rest (final chunks, usage, [DONE]) goes out in one write.
    held = b""
    try:
        if first is not None:
            data = responder.stream_batch(first)
            if responder.all_done:
                held += data
            elif data:
                yield data
        async for batch in choices:
            data = responder.stream_events(*batch[0]) if len(batch) == 1 else responder.stream_batch(batch)
            if held or responder.all_done:
                held += data
            elif data:
                yield data
        usage = responder.usage_chunk()
        if usage is not None:
            held += sse(usage)
    except (EngineStreamBroken, EngineRejected, NoReplica) as exc:
        # Past the first event the status line is gone: an OpenAI-style error object, then [DONE].
        gateway.stats.stream_errors += 1
        metrics.STREAM_ERRORS.inc()
        status = exc.status if isinstance(exc, EngineRejected) else 502
        message = exc.message() if isinstance(exc, EngineRejected) else str(exc)
        logger.warning("stream %s failed after its first event: %s", responder.response_id, message)
        held += b"data: " + error_body(ApiError(f"engine failed mid-stream: {message}", status,
                                                type="BadGatewayError" if status == 502 else None)) + b"\n\n"
    yield held + DONE


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def client_went_away(watcher: asyncio.Future) -> bool:
    """The disconnect watcher returned: it saw ``http.disconnect`` (not cancelled, not failed)."""
    return watcher.done() and not watcher.cancelled() and watcher.exception() is None


class GatewayStream:
    """SSE out, a bare ASGI response. Watches the client: if it goes away, the engine requests are aborted
    at once (not at the next write), and the event generator is closed so its engine connections close too."""

    status_code = 200
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], gateway: Gateway, call: EngineCall,
                 choices: AsyncIterator[Any]) -> None:
        self.events = events
        self.gateway = gateway
        self.call = call
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        # The events are written by their own task, whose await chain is short: a wake-up per engine event
        # resumes only its frames, not uvicorn's and the middleware's above this one. This task watches the
        # client meanwhile; uvicorn answers http.disconnect once the response is complete, and the writer's
        # done-callback ends the watch if it stops first (a failure, or a server that keeps receive() open).
        task = asyncio.current_task()
        writer = asyncio.get_running_loop().create_task(self._write(send))
        watching = True

        def writer_done(_: asyncio.Task) -> None:
            if watching:
                task.cancel()

        writer.add_done_callback(writer_done)
        try:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except asyncio.CancelledError:
                if not writer.done():
                    raise  # cancelled from outside (shutdown)
                if hasattr(task, "uncancel"):  # ours, from writer_done: handled
                    task.uncancel()
        finally:
            watching = False
            if not writer.done():  # the client went away mid-stream, or shutdown
                self.gateway.abort_soon(self.call)
                writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await _close_quietly(self.events)
            await _close_quietly(self.choices)
        if not writer.cancelled() and writer.exception() is not None and not isinstance(writer.exception(), OSError):
            logger.error("gateway stream failed", exc_info=writer.exception())

    async def _write(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": list(SSE_HEADERS)})
        async for data in self.events:
            if data.endswith(DONE):  # the last event: it and the body's end in one write
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close_quietly(gen: Any) -> None:
    try:
        await gen.aclose()
    except Exception:  # already closed or failed: nothing left to release
        pass
