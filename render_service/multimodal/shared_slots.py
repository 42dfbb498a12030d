"""Shared memory through which image workers hand their encoded results back. A 1080p image's item is some
17 MB of base64: pickled through the executor's pipe it costs both processes a pass through the kernel in 64 KB
writes and reads, and fresh pages on both sides. Instead the server process owns a few slots (anonymous memory
files, ``memfd``), hands one to each image it submits, and the worker writes the item into it; the server copies
it out once and the slot goes back for the next image, its pages already in place.

A slot is held from submit until its worker is done with it: released when the result is read, when the work
failed or was never started, and when a request that gave up (timeout aside) sees its worker finish. A slot whose
worker may still write (a timeout, a broken pool) is never reused: it is dropped, and its memory goes when the
last mapping does. Where memfd or ``/proc`` is missing, or a slot cannot be reserved, results take the pipe."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import OrderedDict
from itertools import count

import msgspec

KEEP_BYTES = 32 * 1024 * 1024  # slots up to this size are kept for the next image; larger ones serve one
_ROUND = 1024 * 1024
_SUPPORTED = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_POPULATE") and os.path.isdir("/proc/self/fd")


_IDS = count(1)  # slot idents, unique in this process across every set of slots


class SlotRef(msgspec.Struct, frozen=True):
    """A slot as a worker is told of it: the owning process's file descriptor, opened through ``/proc``."""

    owner: int
    fd: int
    ident: int  # unique among the owner's slots (descriptor numbers are reused): a worker's mapping key
    capacity: int
    kept: bool  # reused for image after image (a worker keeps its mapping); else closed after one


class Slot:
    def __init__(self, ref: SlotRef, memory: mmap.mmap) -> None:
        self.ref = ref
        self.memory = memory


def _map(fd: int, size: int) -> mmap.mmap:
    # populated in one call: the first write or read takes no page faults
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


class SharedSlots:
    """At most ``limit`` slots of one process; ``acquire`` waits while all are held."""

    def __init__(self, limit: int, keep_bytes: int = KEEP_BYTES) -> None:
        self.limit = limit
        self.keep_bytes = keep_bytes
        self.owner = os.getpid()
        self.enabled = _SUPPORTED
        self._free: list[Slot] = []
        self.held = 0  # slots handed out and not yet released or dropped
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def live(self) -> int:
        return self.held + len(self._free)

    async def acquire(self, size: int) -> Slot | None:
        """A slot of at least ``size`` bytes, or None (the result then takes the pipe; also in a process forked
        from the owner, whose workers would open the owner's slots)."""
        while self.enabled and self.owner == os.getpid():
            fits = [slot for slot in self._free if slot.ref.capacity >= size]
            if fits:
                slot = min(fits, key=lambda s: s.ref.capacity)
                self._free.remove(slot)
                self.held += 1
                return slot
            if self.live >= self.limit and self._free:  # all free ones too small: make room for a larger one
                self._close(self._free.pop(self._free.index(min(self._free, key=lambda s: s.ref.capacity))))
            if self.live < self.limit:
                made = self._create(size)
                if made is not None:
                    self.held += 1
                return made
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken but leaving: the next waiter gets the turn
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return None

    def _create(self, size: int) -> Slot | None:
        capacity = -(-max(size, 1) // _ROUND) * _ROUND
        try:
            fd = os.memfd_create("splitserve-image", os.MFD_CLOEXEC)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, capacity)  # reserved now: no SIGBUS on a full tmpfs mid-write
            memory = _map(fd, capacity)
        except OSError:
            os.close(fd)
            return None
        return Slot(SlotRef(self.owner, fd, next(_IDS), capacity, capacity <= self.keep_bytes), memory)

    def read(self, slot: Slot, length: int) -> bytes:
        return slot.memory[:length]

    def release(self, slot: Slot) -> None:
        """The slot's worker is done with it."""
        self.held -= 1
        if not slot.ref.kept or not self.enabled:
            self._close(slot)
        else:
            self._free.append(slot)
        self._wake()

    def drop(self, slot: Slot) -> None:
        """A slot its worker may still write: never handed out again."""
        self.held -= 1
        self._close(slot)
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
                return

    def _close(self, slot: Slot) -> None:
        slot.memory.close()
        os.close(slot.ref.fd)

    def close(self) -> None:
        """Every free slot closed (held ones close as they come back) and no new ones made."""
        self.enabled = False
        while self._free:
            self._close(self._free.pop())
        self._wake()


class SlotUnavailable(Exception):
    """A worker could not open the slot it was handed (no /proc, another user): its server stops using slots."""


# In a worker: mappings of the slots it was handed, by (owner, ident); a few, the most recent kept.
_MAPPED: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()
_MAPPED_MAX = 4


class AttachedSlot:
    """In a worker, while it works on one image: the slot it was handed, mapped (a kept slot's mapping stays for
    the next image; any other is closed on exit, as its owner closes it after this image)."""

    def __init__(self, ref: SlotRef) -> None:
        self.ref = ref
        key = (ref.owner, ref.ident)
        memory = _MAPPED.pop(key, None)
        if memory is None:
            try:
                fd = os.open(f"/proc/{ref.owner}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise SlotUnavailable(f"{type(exc).__name__}: {exc}") from None
            try:
                memory = _map(fd, ref.capacity)
            except OSError as exc:
                raise SlotUnavailable(f"{type(exc).__name__}: {exc}") from None
            finally:
                os.close(fd)
        self.memory = memory

    def __enter__(self) -> AttachedSlot:
        return self

    def __exit__(self, *_: object) -> None:
        if not self.ref.kept:
            self.memory.close()
            return
        _MAPPED[(self.ref.owner, self.ref.ident)] = self.memory
        while len(_MAPPED) > _MAPPED_MAX:
            _MAPPED.popitem(last=False)[1].close()

    def read(self, length: int) -> bytes:
        """The image's bytes its server put at the slot's start."""
        return self.memory[:length]

    def write_quoted(self, text: bytes) -> int | None:
        """``text`` written into the slot as a JSON string (quotes around it), its length returned; None when it
        does not fit (the caller then returns it through the pipe)."""
        length = len(text) + 2
        if length > self.ref.capacity:
            return None
        memory = self.memory
        memory[0:1] = b'"'
        memory[1:length - 1] = text
        memory[length - 1:length] = b'"'
        return length
