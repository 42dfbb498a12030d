"""Where render work runs, how much of it may wait, and what an operator sees of both.

The event loop only moves bytes: render work (JSON decode, chat template, tokenizing, JSON encode) runs on
worker threads, so /health, /metrics and streaming derender keep answering while a prompt renders, and
requests that wait are counted (they wait here, not unseen in the loop's ready queue or socket buffers).
Two lanes of one thread each: bodies under ``bulk_bytes`` take the interactive lane, bigger ones the bulk
lane, so a multi-megabyte prompt never queues small renders behind it. The tokenizers release the GIL while
they work; what holds it (Jinja, msgspec) is short and is preempted every few milliseconds.

Admission: with ``max_queued``, a request that would wait behind ``max_queued`` others is answered 429 with
``Retry-After`` (the expected drain time of the queue in whole seconds, at least 1), before its body is
decoded. The gateway renders its small bodies inline (``inline_below``): its loop is busy relaying streams,
and a hop to a thread would make a short render wait for the GIL behind them.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from render_service import metrics
from render_service.errors import ApiError

T = TypeVar("T")

# A body this large (a ~60k-token prompt and up) renders on the bulk lane.
BULK_BODY_BYTES = 256 * 1024


class RenderQueue:
    def __init__(self, max_queued: int | None = None, *, bulk_bytes: int = BULK_BODY_BYTES) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        self.max_queued = max_queued
        self.bulk_bytes = bulk_bytes
        self._lanes = {name: ThreadPoolExecutor(1, thread_name_prefix=f"render-{name}")
                       for name in ("interactive", "bulk")}
        self._lock = threading.Lock()  # the counters change on the loop thread and on the lane threads
        self.waiting = 0
        self.running = 0
        self._work_s = 0.002  # moving average of one job's time, for Retry-After

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.waiting * self._work_s / len(self._lanes)))

    async def run(self, endpoint: str, size: int, job: Callable[[], T], *, inline_below: int = 0) -> T:
        """``job()``'s result, run on a lane (or inline for a body under ``inline_below`` bytes); 429 when the
        queue is full. Exceptions of ``job`` propagate."""
        if size < inline_below:
            return self._timed(endpoint, 0.0, job)
        if self.max_queued is not None and self.waiting >= self.max_queued:
            metrics.RENDER_REJECTED.labels(reason="queue_full").inc()
            raise ApiError(
                f"The render queue is full ({self.waiting} requests waiting); retry later or on another replica.",
                429, headers={"Retry-After": str(self.retry_after_s())})
        lane = self._lanes["bulk" if size >= self.bulk_bytes else "interactive"]
        queued_at = time.perf_counter()
        with self._lock:
            self.waiting += 1
            metrics.RENDER_QUEUE_DEPTH.set(self.waiting)
        future = lane.submit(self._from_queue, endpoint, queued_at, job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancel():  # it never started: it no longer waits
                with self._lock:
                    self.waiting -= 1
                    metrics.RENDER_QUEUE_DEPTH.set(self.waiting)
            raise

    def _from_queue(self, endpoint: str, queued_at: float, job: Callable[[], T]) -> T:
        with self._lock:
            self.waiting -= 1
            metrics.RENDER_QUEUE_DEPTH.set(self.waiting)
        return self._timed(endpoint, time.perf_counter() - queued_at, job)

    def _timed(self, endpoint: str, waited_s: float, job: Callable[[], T]) -> T:
        metrics.RENDER_QUEUE_WAIT.observe(waited_s)
        with self._lock:
            self.running += 1
            metrics.RENDER_IN_FLIGHT.set(self.running)
        started = time.perf_counter()
        try:
            return job()
        finally:
            spent = time.perf_counter() - started
            self._work_s += (spent - self._work_s) * 0.1
            metrics.observe_render_work(endpoint, spent)
            with self._lock:
                self.running -= 1
                metrics.RENDER_IN_FLIGHT.set(self.running)

    def shutdown(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
