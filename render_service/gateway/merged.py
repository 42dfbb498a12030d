"""The engine streams of one response, opened together and merged, their events pushed to one consumer.

A response has one engine stream (n = 1, or n > 1 collocated) or several (several completions prompts, or
n > 1 in P/D, planned by ``flow.plan_streams``). Each is opened (retried until its first events) before
the response starts, so a failure before then is still an HTTP error with its status. After that their
events arrive in the engine connections' data callbacks (``LiveStream.push``) and go to the consumer as
(prompt index, choice) items with the response's choice indexes; a stream whose choices a stop string has
all ended is aborted and closed at once. The consumer hears once that it is over: after every stream's
[DONE] (or stop), or at the first failure, which closes the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from render_service.gateway import metrics
from render_service.gateway.flow import EngineCall, EngineStream, Gateway, LiveStream, WholeResponse
from render_service.wire.protocol import GeneratePromptLogprobs, GenerateStreamChoice, GenerateStreamResponse

logger = logging.getLogger("render_service.gateway.merged")

Items = list[tuple[int, GenerateStreamChoice]]
SpanDone = Callable[[int, int, int], bool]  # (prompt index, first choice, count): those choices all ended


async def open_merged(gateway: Gateway, planned: list[EngineStream], call: EngineCall,
                      span_done: SpanDone | None) -> MergedStreams:
    """Open every planned stream (concurrently) up to its first events; a failure closes the others."""
    if len(planned) == 1:
        return MergedStreams(gateway, call, planned, [await gateway.open(planned[0].gen, call)], span_done)
    tasks = [asyncio.ensure_future(gateway.open(s.gen, call)) for s in planned]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        failed = [t for t in tasks if not t.done() or t.cancelled() or t.exception() is not None]
        if failed:  # one failed (or we were cancelled): nothing is served, nothing stays open
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tasks:
                if not t.cancelled() and t.exception() is None:
                    t.result().close()
    for t in tasks:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error
    return MergedStreams(gateway, call, planned, [t.result() for t in tasks], span_done)


def _check_prompt(plan: EngineStream, engine_prompt_tokens: int | None) -> None:
    """The engine's usage against the ids render produced: a difference is counted and logged, never fatal."""
    rendered = len(plan.gen.token_ids)
    if engine_prompt_tokens is None or engine_prompt_tokens == rendered:
        return
    metrics.RENDER_ENGINE_MISMATCHES.inc()
    logger.warning("engine received a %d-token prompt where render produced %d for request %s: the ids changed "
                   "between render and the engine", engine_prompt_tokens, rendered, plan.gen.request_id,
                   extra={"rendered_tokens": rendered, "engine_tokens": engine_prompt_tokens})


def _not_started(*_: object) -> None:
    raise RuntimeError("MergedStreams: an event arrived before start()")


class _Stream:
    __slots__ = ("plan", "live", "engine_finished", "ended")

    def __init__(self, plan: EngineStream, live: LiveStream | WholeResponse) -> None:
        self.plan = plan
        self.live = live
        self.engine_finished: set[int] = set()  # choice indexes the engine finished
        self.ended = False


class MergedStreams:
    """The opened streams of one response; ``start`` hands their events to one consumer (module docstring)."""

    def __init__(self, gateway: Gateway, call: EngineCall, planned: list[EngineStream],
                 lives: list[LiveStream | WholeResponse], span_done: SpanDone | None) -> None:
        self.gateway = gateway
        self.call = call
        self.span_done = span_done
        self.streams = [_Stream(plan, live) for plan, live in zip(planned, lives)]
        self.remaining = len(self.streams)
        self.over = False
        # the consumer's callbacks, given to start()
        self._on_choice: Callable[[int, GenerateStreamChoice], None] = _not_started
        self._on_items: Callable[[Items], None] = _not_started
        self._on_over: Callable[[Exception | None], None] = _not_started

    def prompt_logprobs(self) -> dict[int, GeneratePromptLogprobs | None]:
        """Prompt index -> the engine's prompt_logprobs, for the prompts that asked for them."""
        return {s.plan.prompt_index: s.live.prompt_logprobs for s in self.streams
                if isinstance(s.live, WholeResponse)}

    def start(self, on_choice: Callable[[int, GenerateStreamChoice], None], on_items: Callable[[Items], None],
              on_over: Callable[[Exception | None], None]) -> None:
        """Each stream's first events, then the rest as they arrive: a read with one choice event (the
        per-token case) as ``on_choice(prompt index, choice)``, any other as ``on_items``; neither may raise."""
        self._on_choice, self._on_items, self._on_over = on_choice, on_items, on_over
        for s in self.streams:
            self._batch(s, s.live.first)
        for s in self.streams:
            if not s.ended and not self.over:
                s.live.push(partial(self._batch, s), partial(self._end, s))

    def _batch(self, s: _Stream, batch: list[GenerateStreamResponse]) -> None:
        if s.ended or self.over:
            return
        plan = s.plan
        if len(batch) == 1 and len(batch[0].choices) == 1 and not plan.first:  # the per-token common case
            choice = batch[0].choices[0]
            if choice.finish_reason is not None:
                s.engine_finished.add(choice.index)
            self._on_choice(plan.prompt_index, choice)
        else:
            items = self._items(s, batch)
            if items:
                self._on_items(items)
            for chunk in batch:
                if chunk.usage is not None:
                    _check_prompt(plan, chunk.usage.prompt_tokens)
        # Ended by us (stop strings) while the engine still generates: abort it. An engine that finished is
        # read to [DONE], which keeps its connection for the next request.
        if self.span_done is not None and not self.over and len(s.engine_finished) < plan.count \
                and self.span_done(plan.prompt_index, plan.first, plan.count):
            self.gateway.abort_soon(self.call, plan.gen.request_id if len(self.streams) > 1 else None)
            s.live.close()
            self._end(s, None)

    @staticmethod
    def _items(s: _Stream, batch: list[GenerateStreamResponse]) -> Items:
        plan = s.plan
        items = []
        for chunk in batch:
            for choice in chunk.choices:
                if choice.finish_reason is not None:
                    s.engine_finished.add(choice.index)
                if plan.first:
                    choice.index += plan.first
                items.append((plan.prompt_index, choice))
        return items

    def _end(self, s: _Stream, error: Exception | None) -> None:
        if s.ended or self.over:
            return
        s.ended = True
        self.remaining -= 1
        if error is not None:
            self.close()  # the response has failed: the other streams have nobody to serve
            self._over(error)
        elif self.remaining == 0:
            self._over(None)

    def _over(self, error: Exception | None) -> None:
        self.over = True
        self._on_over(error)

    def pause(self) -> None:
        for s in self.streams:
            if not s.ended:
                s.live.pause()

    def resume(self) -> None:
        for s in self.streams:
            if not s.ended:
                s.live.resume()

    def close(self) -> None:
        """Stop every stream (their connections close: the engines abort); the consumer hears nothing more."""
        self.over = True
        for s in self.streams:
            s.live.close()
