"""Where render work runs, how much of it may wait, and what an operator sees of both.

Bodies under ``bulk_bytes`` render on the event loop, one after another: a hop to a thread costs more than a
small render (and, on a busy machine, a scheduling delay per hop), and such a render holds the loop for a
few milliseconds at most. Larger bodies render on the *bulk* lane, a thread of its own, so a multi-megabyte
prompt never stalls ``/health``, ``/metrics``, derender or the small renders of other clients (the
tokenizers release the GIL while they work; what holds it, Jinja and msgspec, is preempted every few ms).

Every render is admitted first: it counts as waiting until its work starts. A small render yields to the loop
once before it starts, so requests that arrived together are all admitted (and counted) before the first of
them runs; while renders run back to back, what arrives meanwhile waits in that count. With ``max_queued``, a
render that finds ``max_queued`` others waiting is answered 429 with ``Retry-After`` (the expected drain time
in whole seconds, at least 1) before its body is decoded.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from render_service.http import metrics
from render_service.http.errors import ApiError

T = TypeVar("T")

# A body this large (a ~60k-token prompt and up) renders on the bulk lane.
BULK_BODY_BYTES = 256 * 1024


class RenderQueue:
    def __init__(self, max_queued: int | None = None, *, bulk_bytes: int = BULK_BODY_BYTES) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        self.max_queued = max_queued
        self.bulk_bytes = bulk_bytes
        self._bulk = ThreadPoolExecutor(1, thread_name_prefix="render-bulk")
        self._lock = threading.Lock()  # the counters change on the loop thread and on the bulk thread
        self.waiting = 0
        self.running = 0
        self._work_s = 0.002  # moving average of one job's time, for Retry-After

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.waiting * self._work_s))

    async def run(self, endpoint: str, size: int, job: Callable[[], T]) -> T:
        """``job()``'s result, run inline or on the bulk lane (bodies of ``bulk_bytes`` and more); 429 when the
        queue is full. Exceptions of ``job`` propagate."""
        if self.max_queued is not None and self.waiting >= self.max_queued:
            metrics.RENDER_REJECTED.labels(reason="queue_full").inc()
            raise ApiError(
                f"The render queue is full ({self.waiting} requests waiting); retry later or on another replica.",
                429, headers={"Retry-After": str(self.retry_after_s())})
        queued_at = time.perf_counter()
        self._waits(+1)
        if size < self.bulk_bytes:
            try:
                await asyncio.sleep(0)
            finally:
                self._waits(-1)
            return self._timed(endpoint, time.perf_counter() - queued_at, job)
        future = self._bulk.submit(self._from_queue, endpoint, queued_at, job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancel():  # it never started: it no longer waits
                self._waits(-1)
            raise

    def _waits(self, change: int) -> None:
        with self._lock:
            self.waiting += change
            metrics.RENDER_QUEUE_DEPTH.set(self.waiting)

    def _from_queue(self, endpoint: str, queued_at: float, job: Callable[[], T]) -> T:
        self._waits(-1)
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

    def warm(self, job: Callable[[], object]) -> Future[object]:
        """Runs ``job`` on the bulk lane now, so that the lane's thread exists and has paid its first-use costs
        before the first large body: the tokenizer sets up per-thread state on a thread's first encode, which
        made the first 128k-token growing turn on the lane cost 23 ms against 2-3 ms for the next ones. Call it
        in the serving process (a thread does not survive a fork)."""
        return self._bulk.submit(job)

    def shutdown(self) -> None:
        self._bulk.shutdown(wait=False, cancel_futures=True)
