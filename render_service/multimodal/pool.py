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
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import msgspec
from PIL import Image

from render_service.caches.byte_lru import ByteLRU
from render_service.http.errors import ApiError
from render_service.multimodal import gemma4
from render_service.multimodal.bounds import ImageError, ImageHeader, decode_rgb
from render_service.multimodal.families import BudgetFamily, Family
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.qwen_vl import grid_thw, image_token_count, patches_shape, pixel_values
from render_service.multimodal.shared_slots import AttachedSlot, SharedSlots, Slot, SlotRef, SlotUnavailable
from render_service.multimodal.wire import ItemLayout, b64encode, item_layout, metadata_item


class ProcessedImage(msgspec.Struct, frozen=True):
    mm_hash: str
    grid_thw: tuple[int, int, int] | None  # the patch grid (Qwen-VL); None for a budget family
    num_tokens: int
    # vLLM's wire item (``wire``): pixel values and grid, as its JSON string (quotes included); None for mm_payload
    # none
    kwargs_item: bytes | None = None
    metadata_item: str | None = None  # the grid alone, as vLLM's mm_metadata item (Gemma 4 has none)

    @property
    def nbytes(self) -> int:
        return 256 + sum(len(text) for text in (self.kwargs_item, self.metadata_item) if text is not None)


# A worker's buffer for one item's msgpack bytes, kept between images up to this size (fresh pages cost a fault
# each: some 3,000 for a 1080p image's 12.6 MB).
_KEEP_BUFFER = 32 * 1024 * 1024
_SLOT_INPUT = 64 * 1024  # an image this large goes to its worker through a slot even when no item comes back
_PILLOW_BLOCKS = 4  # Pillow's memory blocks (16 MB each) a worker keeps for its next image
_ALIGN = 64  # the pixel values start on this boundary inside the buffer (float32 writes stay aligned)
_buffer = bytearray()


def _item_bytes(layout: ItemLayout) -> tuple[memoryview, memoryview]:
    """(the whole item, its pixel values' bytes) in this worker's buffer, the prefix and suffix written."""
    global _buffer
    start = -len(layout.prefix) % _ALIGN
    end = start + layout.total
    buffer = _buffer if len(_buffer) >= end else bytearray(end)
    if end <= _KEEP_BUFFER and buffer is not _buffer:
        _buffer = buffer
    view = memoryview(buffer)
    values_at = start + len(layout.prefix)
    view[start:values_at] = layout.prefix
    view[values_at + layout.size:end] = layout.suffix
    return view[start:end], view[values_at:values_at + layout.size]


def process_image(data: bytes | None, header: ImageHeader, family: Family, model_id: str,
                  tensors: bool, normalize: bool = False, slot: SlotRef | None = None, data_length: int = 0
                  ) -> tuple[ProcessedImage, int]:
    """Runs in a worker: decode (bounded by ``header``, already checked), hash as vLLM, count placeholder
    tokens and, with ``tensors``, produce the pixel values (``normalize``: float32 normalised, else the raw
    uint8 pixels an engine normalising on its device wants) written straight into their item's msgpack bytes.
    ``data`` None: the image's ``data_length`` bytes are at the start of ``slot``. With a ``slot``, the item's
    JSON string goes there and its length comes back (the result's item is then None); else (0) it is in the
    result."""
    if slot is None:
        assert data is not None
        return _process(data, header, family, model_id, tensors, normalize, None)
    with AttachedSlot(slot) as shared:
        return _process(shared.read(data_length) if data is None else data, header, family, model_id, tensors,
                        normalize, shared)


def _process(data: bytes, header: ImageHeader, family: Family, model_id: str, tensors: bool,
             normalize: bool, shared: AttachedSlot | None) -> tuple[ProcessedImage, int]:
    image, converted = decode_rgb(data, header, "image")
    digest = image_hash(data, model_id, converted=converted)
    if isinstance(family, BudgetFamily):
        return _process_budget(image, digest, family, tensors, shared)
    num_tokens = image_token_count(image.height, image.width, family)
    grid = grid_thw(image.height, image.width, family)
    if not tensors:
        return ProcessedImage(digest, grid, num_tokens), 0
    layout = item_layout("float32" if normalize else "uint8", *patches_shape(grid, family), grid)
    item, values = _item_bytes(layout)
    pixel_values(image, family, normalize, values)
    del image
    return _finish(ProcessedImage(digest, grid, num_tokens, None, metadata_item(grid)), b64encode(item), shared)


def _process_budget(image: Image.Image, digest: str, family: BudgetFamily, tensors: bool,
                    shared: AttachedSlot | None) -> tuple[ProcessedImage, int]:
    num_tokens = gemma4.soft_token_count(image.height, image.width, family)
    if not tensors:
        return ProcessedImage(digest, None, num_tokens), 0
    item, values = _item_bytes(gemma4.item_layout(image.height, image.width, family))
    gemma4.pixel_values(image, family, values)
    del image
    return _finish(ProcessedImage(digest, None, num_tokens), b64encode(item), shared)


def _finish(result: ProcessedImage, text: bytes, shared: AttachedSlot | None) -> tuple[ProcessedImage, int]:
    """``result`` with its item's base64 ``text``: written into the slot (its length comes back) or kept."""
    length = shared.write_quoted(text) if shared is not None else None
    if length is not None:
        return result, length
    return msgspec.structs.replace(result, kwargs_item=b"".join((b'"', text, b'"'))), 0


def item_bound(header: ImageHeader, family: Family, normalize: bool) -> int:
    """The most bytes an image with this header can need as its item's JSON string (its pixels may turn by
    EXIF orientation: both ways counted); 0 when it is refused anyway."""
    if isinstance(family, BudgetFamily):  # a fixed size: the budget's patches
        return 4 * -(-gemma4.item_layout(header.height, header.width, family).total // 3) + 2
    try:
        grids = [grid_thw(h, w, family) for w, h in ((header.width, header.height), (header.height, header.width))]
    except ImageError:
        return 0
    dtype = "float32" if normalize else "uint8"
    total = max(item_layout(dtype, *patches_shape(grid, family), grid).total for grid in grids)
    return 4 * -(-total // 3) + 2


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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_HEAP = 64 * 1024 * 1024


def _keep_heap() -> None:
    """glibc hands an image's freed megabytes back to the kernel at once by default (its trim threshold follows the
    largest block freed), and the next image faults them in again, zeroed: 3-4 ms of a 1080p image. A worker keeps
    up to 64 MiB of free heap instead, and takes blocks up to 32 MiB (a 1080p item's 17 MB base64) from it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BUFFER)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_HEAP)
    except (OSError, AttributeError):  # not glibc: its own defaults
        pass


def _init_worker(parent: int) -> None:
    _die_with_parent(parent)
    _keep_heap()
    # Pillow frees an image's memory blocks at once by default; a few kept make the next decode and resize reuse
    # pages already faulted in (a 1080p image's decode and resize are 16 MB of fresh pages otherwise)
    Image.core.set_blocks_max(_PILLOW_BLOCKS)


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
        # where workers write their items: one per image being worked on, and one or two more ready
        self.slots = SharedSlots(self.workers + 2)
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
                                   initializer=_init_worker, initargs=(os.getpid(),))

    def executor(self) -> ProcessPoolExecutor:
        """This process's executor. ``--workers N`` builds the app once and forks: an executor made before the
        fork would hand every server process the same call and result pipes, so each makes its own."""
        if self._executor is None or self._owner != os.getpid():
            self._executor, self._owner = self._new_executor(), os.getpid()
            # a forked process's slots are its own too (a worker opens a slot through its owner's pid)
            self.slots = SharedSlots(self.workers + 2)
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

    async def process(self, key: str, data: bytes, header: ImageHeader, family: Family, model_id: str,
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
        try:
            result = await self._work(data, header, family, model_id, tensors, normalize)
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

    async def _work(self, data: bytes, header: ImageHeader, family: Family, model_id: str, tensors: bool,
                    normalize: bool) -> ProcessedImage:
        """One image through a worker, its bytes and its item passed through a shared slot where one is to be had
        (the bytes alone when the image is large: a router's PNG screenshots)."""
        self.executor()  # first: a forked process makes its own slots with its executor
        slots = self.slots
        bound = item_bound(header, family, normalize) if tensors else 0
        slot = await slots.acquire(max(bound, len(data))) if bound or len(data) >= _SLOT_INPUT else None
        if slot is not None:
            slot.memory[:len(data)] = data
        executor = self.executor()  # after the wait for a slot: a broken pool may have been replaced meanwhile
        work = executor.submit(process_image, None if slot is not None else data, header, family, model_id,
                               tensors, normalize, None if slot is None else slot.ref, len(data))
        try:
            result, length = await asyncio.wait_for(asyncio.wrap_future(work), self.work_timeout_s)
        except (BrokenProcessPool, TimeoutError):
            # a worker died (killed for memory, or by an operator) or stopped answering: this request's images are
            # lost, the next request gets a fresh pool rather than the broken one forever
            if slot is not None:
                slots.drop(slot)  # a worker that stopped answering may still write into it
            if self._executor is executor:
                self._executor = self._new_executor()
                executor.shutdown(wait=False, cancel_futures=True)
            raise ApiError("An image worker process died while processing this request; retry it.", 503,
                           headers={"Retry-After": "1"}) from None
        except SlotUnavailable:
            assert slot is not None
            slots.release(slot)
            slots.enabled = False  # (once, for every image after it: the pipe)
            return await self._work(data, header, family, model_id, tensors, normalize)
        except BaseException:
            if slot is not None:
                _release_when_done(work, slots, slot)  # a refused image, or a request that gave up
            raise
        if slot is None:
            return result
        try:
            return msgspec.structs.replace(result, kwargs_item=slots.read(slot, length)) if length else result
        finally:
            slots.release(slot)

    def warm_up(self) -> None:
        """Start every worker now (spawned workers import numpy and Pillow: seconds, not on a request)."""
        for future in [self.executor().submit(os.getpid) for _ in range(self.workers)]:
            future.result()

    def shutdown(self) -> None:
        if self._executor is not None and self._owner == os.getpid():
            self._executor.shutdown(wait=True, cancel_futures=True)
            self.slots.close()


def _release_when_done(work: Future[tuple[ProcessedImage, int]], slots: SharedSlots, slot: Slot) -> None:
    """``slot`` back to ``slots`` once ``work``'s worker cannot write into it any more: now when it is done (it
    failed, or was cancelled before it started), else when it finishes."""
    if work.done():
        slots.release(slot)
        return
    loop = asyncio.get_running_loop()

    def done(_: Future[tuple[ProcessedImage, int]]) -> None:  # on the executor's thread
        try:
            loop.call_soon_threadsafe(slots.release, slot)
        except RuntimeError:  # the loop is gone: so is the server
            pass

    work.add_done_callback(done)
