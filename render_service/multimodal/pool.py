"""Image preprocessing in worker processes: decoding, resizing, normalising and patchifying hold the GIL in
Pillow and numpy for milliseconds per image, so they run in a process pool, never on the event loop or its
threads. Identical bytes are processed once: results are kept by content hash in a bounded LRU cache, and a
second request for bytes already in flight waits for the first. Work beyond ``max_pending`` images is a 429
with Retry-After, like the text render queue."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import msgspec

from render_service.caches.byte_lru import ByteLRU
from render_service.http.errors import ApiError
from render_service.multimodal.bounds import ImageHeader, decode_rgb
from render_service.multimodal.families import VisionFamily
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.qwen_vl import grid_thw, image_token_count, pixel_values
from render_service.multimodal.wire import kwargs_item, metadata_item


class ProcessedImage(msgspec.Struct, frozen=True):
    mm_hash: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    # vLLM's wire item (``wire``): pixel values and grid, as its JSON string (quotes included); None for mm_payload
    # none
    kwargs_item: bytes | None = None
    metadata_item: str | None = None  # the grid alone, as vLLM's mm_metadata item

    @property
    def nbytes(self) -> int:
        return 256 + sum(len(text) for text in (self.kwargs_item, self.metadata_item) if text is not None)


def process_image(data: bytes, header: ImageHeader, family: VisionFamily, model_id: str,
                  tensors: bool, normalize: bool = False) -> ProcessedImage:
    """Runs in a worker: decode (bounded by ``header``, already checked), hash as vLLM, count placeholder
    tokens and, with ``tensors``, produce the pixel values (``normalize``: float32 normalised, else the raw
    uint8 pixels an engine normalising on its device wants)."""
    image, converted = decode_rgb(data, header, "image")
    digest = image_hash(data, model_id, converted=converted)
    num_tokens = image_token_count(image.height, image.width, family)
    if not tensors:
        return ProcessedImage(digest, grid_thw(image.height, image.width, family), num_tokens)
    values, grid = pixel_values(image, family, normalize)
    rows, patch_dim = int(values.shape[0]), int(values.shape[1])
    item = kwargs_item(values.data.cast("B"), str(values.dtype), rows, patch_dim, grid)  # (no copy)
    return ProcessedImage(digest, grid, num_tokens, item, metadata_item(grid))


def _die_with_parent(parent: int) -> None:
    """A worker ends when its server process does, however that ends (a killed server's workers would otherwise
    wait on their queue forever): Linux's parent-death signal, then a check for a parent already gone."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the check below still catches an early death
        pass
    if os.getppid() != parent:
        os._exit(0)


class ImagePool:
    def __init__(self, workers: int | None = None, *, max_pending: int = 256, cache_bytes: int = 512 * 1024 * 1024,
                 cache_entries: int = 4096, work_timeout_s: float = 120.0) -> None:
        """``work_timeout_s``: how long one image may take before its worker counts as dead (a worker killed
        while sending its answer leaves the executor waiting for the rest of it forever)."""
        self.work_timeout_s = work_timeout_s
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        # forkserver/spawn: a forked copy of a threaded server (tokenizers, the bulk lane) can deadlock
        self._executor: ProcessPoolExecutor | None = None  # made on first use, in the process that uses it
        self._owner = 0
        self.max_pending = max_pending
        self.pending = 0
        self._work_s = 0.02  # moving average of one image's work, for Retry-After
        # Results by (content hash, tensors or not); one image as large as the whole bound is still kept.
        self.cache: ByteLRU[tuple[str, bool], ProcessedImage] = ByteLRU(
            cache_bytes, max_entry_bytes=cache_bytes, max_entries=cache_entries)
        self._inflight: dict[tuple[str, bool], asyncio.Future[ProcessedImage]] = {}
        self.processed = 0  # images that went to a worker (the rest came from the cache or a twin in flight)

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_die_with_parent, initargs=(os.getpid(),))

    def executor(self) -> ProcessPoolExecutor:
        """This process's executor. ``--workers N`` builds the app once and forks: an executor made before the
        fork would hand every server process the same call and result pipes, so each makes its own."""
        if self._executor is None or self._owner != os.getpid():
            self._executor, self._owner = self._new_executor(), os.getpid()
        return self._executor

    def known(self, key: str, tensors: bool) -> bool:
        """Whether ``key``'s result is cached or being computed (it then costs the queue nothing)."""
        return (key, tensors) in self.cache or (key, tensors) in self._inflight

    def admit(self, count: int) -> None:
        """A 429 with Retry-After when ``count`` more images would pass ``max_pending``."""
        if self.pending + count > self.max_pending:
            retry = max(1, math.ceil(self.pending * self._work_s / self.workers))
            raise ApiError(f"The image preprocessing queue is full ({self.pending} images pending); retry later or "
                           "on another replica.", 429, headers={"Retry-After": str(retry)})

    async def process(self, key: str, data: bytes, header: ImageHeader, family: VisionFamily, model_id: str,
                      tensors: bool, normalize: bool = False) -> ProcessedImage:
        cache_key = (key, tensors)
        hit = self.cache.get(cache_key)
        if hit is not None:
            return hit
        twin = self._inflight.get(cache_key)
        if twin is not None:
            return await asyncio.shield(twin)
        future: asyncio.Future[ProcessedImage] = asyncio.get_running_loop().create_future()
        self._inflight[cache_key] = future
        self.pending += 1
        started = time.perf_counter()
        executor = self.executor()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(executor.submit(
                process_image, data, header, family, model_id, tensors, normalize)), self.work_timeout_s)
        except (BrokenProcessPool, TimeoutError):
            # a worker died (killed for memory, or by an operator) or stopped answering: this request's images are
            # lost, the next request gets a fresh pool rather than the broken one forever
            if self._executor is executor:
                self._executor = self._new_executor()
                executor.shutdown(wait=False, cancel_futures=True)
            error = ApiError("An image worker process died while processing this request; retry it.", 503,
                             headers={"Retry-After": "1"})
            future.set_exception(error)
            future.exception()
            raise error from None
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a twin that never came leaves no warning
            raise
        finally:
            self.pending -= 1
            self._inflight.pop(cache_key, None)
            self._work_s += (time.perf_counter() - started - self._work_s) * 0.1
        self.processed += 1
        future.set_result(result)
        self.cache.put(cache_key, result, result.nbytes)
        return result

    def warm_up(self) -> None:
        """Start every worker now (spawned workers import numpy and Pillow: seconds, not on a request)."""
        for future in [self.executor().submit(os.getpid) for _ in range(self.workers)]:
            future.result()

    def shutdown(self) -> None:
        if self._executor is not None and self._owner == os.getpid():
            self._executor.shutdown(wait=True, cancel_futures=True)
