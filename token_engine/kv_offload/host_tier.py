"""The host-memory KV tier: full blocks the device pool evicted, kept for a later prefix hit.

A bounded LRU keyed by the block manager's block hash (which chains the whole prefix and the cache salt, so a hit
is the same tokens in the same context). Entries are copies of one block of the device pool (all layers, K and
V); a hit copies them back into fresh device blocks instead of recomputing the prefix. It is a cache: it holds
nothing a restart needs, and it is emptied whenever it is bound to a pool whose fingerprint (weights, dtype, KV
layout, block size) differs from the one its entries came from.

Blocks live in one host slab allocated when the tier is bound (pinned on CUDA). Copies are issued when the
scheduler evicts or admits, before the step's forward writes the pool.

- Evictions, on CUDA, neither hold up the host nor the step: a step's evictions are recorded as the scheduler
  makes them and issued together by the first of `fence()` (the engine calls it before the forward), `load()`
  or a rebind. The blocks are gathered into a small device staging buffer on the step's own stream (one kernel,
  ahead of the forward that may overwrite them), and copied from there to the host on a copy stream of their
  own while the forward runs. A writer outside stream order (a NIXL transfer into fresh blocks) calls
  `fence(host=True)`, which waits on the host for the gathers. The staged path proves itself when the tier is
  bound (two blocks must come back byte for byte); otherwise evictions copy straight from the pool on the copy
  stream and `fence()` makes the forward wait for them.
- A load (host to device, `load()`) runs, on CUDA, on a load stream of its own, after the eviction copies it
  depends on (the slots it reads, the device blocks it overwrites); runs of consecutive slots going to
  consecutive blocks are one copy each. Nothing else waits for it: the scheduler keeps the sequence out of its
  steps (WAITING_FOR_REMOTE_KVS, as for a NIXL load) until `finished_loads()` reports the load's event done, and
  only then are its blocks published. The slots a load reads are not dropped or reused until then.
- On CPU copies are plain and immediate; a load is reported finished at the next poll, through the same path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from token_engine.kv_events.recorder import KVEventRecorder


logger = logging.getLogger(__name__)


def kv_fingerprint(model_dir: str | Path, dtype: torch.dtype, block_shape: tuple[int, ...]) -> str:
    """What a stored block's bytes depend on: the model's config and weight files (name, size, mtime), the KV
    dtype and the per-block layout (layers, K/V, block size, heads, head dim)."""
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else []
    for p in files:
        st = p.stat()
        h.update(json.dumps([p.name, st.st_size, st.st_mtime_ns]).encode())
        if p.name == "config.json":
            h.update(p.read_bytes())
    h.update(json.dumps([str(root.resolve()), str(dtype), list(block_shape)]).encode())
    return h.hexdigest()


# CUDA: evicted blocks gathered on the device per host copy (a few dozen MB on a 7B shape; a step's evictions are
# a few dozen blocks, more go through it in turns)
STAGING_BLOCKS = 32
# up to this many runs of consecutive blocks are gathered by a copy each, more by one indexed gather
GATHER_RUNS = 4


def copy_runs(slots: list[int], block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first block, count): the (slot, block) pairs in slot order, consecutive ones merged."""
    runs: list[tuple[int, int, int]] = []
    for slot, block in sorted(zip(slots, block_ids)):
        if runs:
            s, b, n = runs[-1]
            if s + n == slot and b + n == block:
                runs[-1] = (s, b, n + 1)
                continue
        runs.append((slot, block, 1))
    return runs


@dataclass(eq=False)
class HostLoad:
    """One sequence's copies from the tier into its device blocks, issued together."""

    owner: str  # the sequence's id
    slots: list[int]
    num_copies: int  # after merging consecutive runs
    start: torch.cuda.Event | None = None  # CUDA: recorded on the load stream around the copies
    end: torch.cuda.Event | None = None


class HostKVTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.fingerprint: str | None = None
        self.block_bytes = 0
        self.capacity_blocks = 0
        self._pool: torch.Tensor | None = None
        self._pin = False
        # One host slab of capacity_blocks blocks, allocated (and pinned, on CUDA) once when bound.
        self._slab: torch.Tensor | None = None
        self._free_slots: list[int] = []
        self._blocks: OrderedDict[bytes, tuple[int, int | None]] = OrderedDict()  # hash -> (slot, event hash)
        # slot -> loads reading it (taken, or issued and not yet reported finished): never dropped or rewritten
        self._reading: dict[int, int] = {}
        self._free_after_load: set[int] = set()  # read slots whose entries clear() dropped: freed when read
        self._loads: list[HostLoad] = []  # issued, not yet reported by finished_loads(), in issue order
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: evictions' copies, off the step's stream
        self._load_stream: torch.cuda.Stream | None = None  # CUDA: loads, off the step's stream too
        # CUDA: evictions recorded and not yet issued, slot -> device block (a slot dropped and taken again in the
        # same step keeps its last block): issued together, before anything reads the slots or rewrites the blocks
        self._unissued: dict[int, int] = {}
        # CUDA: evicted blocks are gathered into this device buffer on the step's stream (microseconds), and
        # copied to the host from there on the copy stream, so the step's forward never waits for the host copy
        self._staging: torch.Tensor | None = None
        self._staging_free: torch.cuda.Event | None = None  # the copy out of the staging buffer is done
        self._gathered: torch.cuda.Event | None = None  # the gather into the staging buffer is done
        self._staging_used = False  # a copy out of the buffer was issued (its event recorded) since bind
        self._undrained: list[tuple[int, int, int]] = []  # (slot, staging row, count) gathered, not yet copied out
        # the evicted blocks' indices, uploaded from here in one copy per issue (pinned, kept between issues)
        self._index_host: torch.Tensor | None = None
        self._index_device: torch.Tensor | None = None
        self._index_uploaded: torch.cuda.Event | None = None
        self._gathers_pending = False
        self._copies_pending = False  # unstaged evictions (the staged path failed its check) in flight
        self.events: KVEventRecorder | None = None
        # Counters (read by the engine's metrics): blocks and bytes moved each way, time spent moving them.
        self.stored_blocks = 0
        self.loaded_blocks = 0  # counted when a load is reported finished
        self.dropped_blocks = 0
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.load_copies = 0  # copies the loaded blocks took (fewer than blocks when runs merged)
        self.store_seconds = 0.0
        self.load_seconds = 0.0  # host time to issue the loads (on CUDA they run asynchronously)
        self.load_device_seconds = 0.0  # CUDA: the loads' copy time on the GPU, from events, once they finished
        self.invalidations = 0

    # ---- binding ----------------------------------------------------------------------------------
    def bind(self, kv_pool: torch.Tensor, fingerprint: str) -> None:
        """Serve `kv_pool` (blocks on dim 0); entries from a pool with another fingerprint are dropped."""
        self._issue()  # evictions out of the pool bound so far
        self._abandon_loads()  # an earlier engine's loads: its scheduler is gone
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            self.clear()
            self.invalidations += 1
        self.fingerprint = fingerprint
        self._pool = kv_pool
        self._pin = kv_pool.device.type == "cuda"
        if not self._pin:
            self._copy_stream = self._load_stream = None
        elif self._copy_stream is None or self._copy_stream.device != kv_pool.device:
            self._copy_stream = torch.cuda.Stream(kv_pool.device)
            self._load_stream = torch.cuda.Stream(kv_pool.device)
        block_shape = tuple(kv_pool.shape[1:])
        self._staging_free = self._gathered = self._index_uploaded = None
        self._index_host = self._index_device = None
        self._staging_used = False
        self._undrained = []
        self._staging = (torch.empty((STAGING_BLOCKS, *block_shape), dtype=kv_pool.dtype, device=kv_pool.device)
                         if self._pin else None)
        self.block_bytes = kv_pool[0].numel() * kv_pool.element_size()
        capacity = self.capacity_bytes // self.block_bytes
        slab = self._slab
        if slab is None or tuple(slab.shape) != (capacity, *block_shape) or slab.dtype != kv_pool.dtype:
            self.clear()  # entries cannot move to a slab of another shape (a changed layout also changed the print)
            self._slab = torch.empty((capacity, *block_shape), dtype=kv_pool.dtype, pin_memory=self._pin)
            self._free_slots = list(range(capacity - 1, -1, -1))
            self._free_after_load.clear()
        self.capacity_blocks = capacity
        if self._pin and not self._staging_copies_blocks():
            self._staging = None  # evictions copy straight from the pool; the buffer's device memory goes back

    def _staging_copies_blocks(self) -> bool:
        """The staged eviction path, proved on this pool before it serves: blocks gathered by copies (two, not
        neighbours) and by the indexed gather (every other block, more runs than ``GATHER_RUNS``), copied into
        free slots, must come back byte for byte. Otherwise evictions copy straight from the pool on the copy
        stream (and the forward waits for them)."""
        assert self._pool is not None and self._slab is not None
        pool, slab = self._pool, self._slab
        count = pool.shape[0]
        trials = [[0, count - 1] if count > 2 else [0],
                  list(range(0, min(count, 2 * (GATHER_RUNS + 2)), 2))]
        for blocks in trials:
            if len(self._free_slots) < len(blocks):
                return False
            slots = self._free_slots[-len(blocks):]
            try:
                self._unissued = dict(zip(slots, blocks))
                self._issue_staged()
                self.drain()
                torch.cuda.synchronize(pool.device)
                same = all(torch.equal(slab[s].view(torch.uint8), pool[b].cpu().view(torch.uint8))
                           for s, b in zip(slots, blocks))
            except Exception as exc:  # a kernel or copy this build cannot run
                logger.warning("host KV tier: staged evictions failed their check (%s); copying from the pool", exc)
                return False
            finally:
                self._unissued.clear()
                self._undrained = []
                self._gathers_pending = False
            if not same:
                logger.warning("host KV tier: staged evictions did not copy the blocks' bytes; copying from the "
                               "pool")
                return False
        return True

    @property
    def staged_evictions(self) -> bool:
        """CUDA: evictions go through the device staging buffer (proved when bound)."""
        return self._staging is not None

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    @property
    def num_free_slots(self) -> int:
        """Slots holding nothing (idle: num_blocks + num_free_slots == capacity_blocks)."""
        return len(self._free_slots)

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    @property
    def busy_slots(self) -> int:
        """Slots a load reads (or is about to): kept until finished_loads() reports it."""
        return len(self._reading)

    def event_hashes(self) -> set[int]:
        """The KV-event hashes of the blocks held (what a router following the events believes is here)."""
        return {h for _, h in self._blocks.values() if h is not None}

    def usage(self) -> float:
        return len(self._blocks) / self.capacity_blocks if self.capacity_blocks else 0.0

    # ---- device -> host ---------------------------------------------------------------------------
    def offload(self, key: bytes, block_id: int, event_hash: int | None) -> None:
        """Copies device block `block_id` (about to be reused) under `key`; a key already held is refreshed. When
        every entry is busy loading, the block is not kept."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        if not self._free_slots and not self._drop_oldest():
            return
        assert self._pool is not None and self._slab is not None, "bind() first"
        slot = self._free_slots.pop()
        if self._copy_stream is not None:
            # Issued with the step's other evictions (_issue): one stream switch for all of them, and runs of
            # consecutive blocks in one copy (each copy issued alone cost the step ~28 us of host time).
            self._unissued[slot] = block_id
        else:
            t0 = time.perf_counter()
            self._slab[slot].copy_(self._pool[block_id])
            self.store_seconds += time.perf_counter() - t0
        self._blocks[key] = (slot, event_hash)
        self.stored_blocks += 1
        self.stored_bytes += self.block_bytes
        if self.events is not None and event_hash is not None:
            self.events.host_stored(event_hash)

    def _drop_oldest(self) -> bool:
        victim = next((k for k, (slot, _) in self._blocks.items() if slot not in self._reading), None)
        if victim is None:
            return False
        slot, event_hash = self._blocks.pop(victim)
        self._free_slots.append(slot)
        self.dropped_blocks += 1
        if self.events is not None and event_hash is not None:
            self.events.host_removed([event_hash])
        return True

    def _issue(self) -> None:
        """Issues the evictions recorded since the last call (CUDA): staged where proved (bind), else straight
        from the pool on the copy stream, after the writes already queued on the step's stream."""
        self.drain()
        if not self._unissued:
            return
        if self._staging is not None:
            self._issue_staged()
            return
        assert self._pool is not None and self._slab is not None and self._copy_stream is not None
        t0 = time.perf_counter()
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for slot, block, n in copy_runs(list(self._unissued), list(self._unissued.values())):
                self._slab[slot:slot + n].copy_(self._pool[block:block + n], non_blocking=True)
        self._unissued.clear()
        self._copies_pending = True
        self.store_seconds += time.perf_counter() - t0

    def _issue_staged(self) -> None:
        """Gathers the evictions recorded since the last call into the staging buffer on the step's stream (after
        the writes already queued there, before any that follow). The copies from the buffer to their slots go on
        the copy stream: a buffer's worth at a time for all but the last, whose copies wait for ``drain`` (the
        engine calls it once the step's forward is queued, so their host time overlaps the GPU's work)."""
        assert self._pool is not None and self._slab is not None and self._staging is not None
        assert self._copy_stream is not None
        t0 = time.perf_counter()
        current = torch.cuda.current_stream(self._copy_stream.device)
        items = sorted(self._unissued.items())  # by slot: consecutive slots are consecutive staging rows
        self._unissued.clear()
        if self._gathered is None or self._staging_free is None:
            self._gathered, self._staging_free = torch.cuda.Event(), torch.cuda.Event()
            self._staging_used = False
        parts = [items[at:at + STAGING_BLOCKS] for at in range(0, len(items), STAGING_BLOCKS)]
        # each part: a copy per run of consecutive blocks where there are few (evictions in LRU order often come in
        # runs), else one indexed gather; the gathers' indices go up in one copy, before anything waits
        runs = [copy_runs(list(range(len(part))), [block for _, block in part]) for part in parts]
        gathered = [block for part, r in zip(parts, runs, strict=True) if len(r) > GATHER_RUNS for _, block in part]
        indices = self._upload_indices(gathered, current) if gathered else None
        at = 0
        for part, part_runs in zip(parts, runs, strict=True):
            self.drain()  # the buffer's previous contents are on their way out first
            if self._staging_used:  # the copy out of the buffer (long done, as a rule)
                current.wait_event(self._staging_free)
            if len(part_runs) <= GATHER_RUNS:
                for row, block, n in part_runs:
                    self._staging[row:row + n].copy_(self._pool[block:block + n], non_blocking=True)
            else:
                assert indices is not None
                torch.index_select(self._pool, 0, indices[at:at + len(part)], out=self._staging[:len(part)])
                at += len(part)
            self._gathered.record(current)
            self._undrained = copy_runs([slot for slot, _ in part], list(range(len(part))))
        self._gathers_pending = True
        self.store_seconds += time.perf_counter() - t0  # on CUDA: the host's time to issue them

    def _upload_indices(self, blocks: list[int], stream: torch.cuda.Stream) -> torch.Tensor:
        """``blocks`` on the device (int64), copied on ``stream`` from a pinned buffer that is rewritten only once
        the previous upload from it has run."""
        count = len(blocks)
        assert self._pool is not None
        if self._index_uploaded is None:
            self._index_uploaded = torch.cuda.Event()
        else:
            self._index_uploaded.synchronize()  # the last upload has read the buffer (a step ago, as a rule)
        if self._index_host is None or self._index_host.numel() < count:
            size = max(count, 4 * STAGING_BLOCKS)
            self._index_host = torch.empty(size, dtype=torch.long, pin_memory=True)
            self._index_device = torch.empty(size, dtype=torch.long, device=self._pool.device)
        assert self._index_device is not None
        self._index_host.numpy()[:count] = blocks
        device = self._index_device[:count]
        device.copy_(self._index_host[:count], non_blocking=True)
        self._index_uploaded.record(stream)
        return device

    def drain(self) -> None:
        """Issues the copies from the staging buffer to the host that ``_issue_staged`` left (CUDA)."""
        runs = self._undrained
        if not runs:
            return
        assert self._slab is not None and self._staging is not None and self._copy_stream is not None
        assert self._gathered is not None and self._staging_free is not None
        t0 = time.perf_counter()
        self._undrained = []
        stream = self._copy_stream
        stream.wait_event(self._gathered)
        with torch.cuda.stream(stream):
            for slot, row, n in runs:
                self._slab[slot:slot + n].copy_(self._staging[row:row + n], non_blocking=True)
        self._staging_free.record(stream)
        self._staging_used = True
        self.store_seconds += time.perf_counter() - t0

    def fence(self, host: bool = False) -> None:
        """What writes the pool next comes after the evictions recorded so far have read it (issued now if they were
        not). On the GPU the gathers are on the step's stream already, ahead of its forward; a writer outside
        stream order (host=True: a NIXL transfer into fresh blocks) waits on the host for them."""
        self._issue()
        if host:
            self.drain()
        if host and self._gathers_pending and self._pool is not None:
            torch.cuda.current_stream(self._pool.device).synchronize()
        self._gathers_pending = False
        stream = self._copy_stream
        if self._copies_pending and stream is not None:  # unstaged evictions still read the pool
            if host:
                stream.synchronize()
            else:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
        self._copies_pending = False

    # ---- host -> device ---------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def take(self, keys: list[bytes]) -> list[int]:
        """Marks `keys` (all held) most recently used and their slots busy until the load that reads them is
        reported finished (or `release()`): offloads while the device blocks are allocated cannot drop them.
        Returns their slots, in order."""
        slots = []
        for k in keys:
            self._blocks.move_to_end(k)
            slot = self._blocks[k][0]
            self._reading[slot] = self._reading.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def release(self, slots: list[int]) -> None:
        """Gives back slots taken for a load that will not happen (or has finished)."""
        for slot in slots:
            n = self._reading[slot] - 1
            if n:
                self._reading[slot] = n
                continue
            del self._reading[slot]
            if slot in self._free_after_load:
                self._free_after_load.discard(slot)
                self._free_slots.append(slot)

    def load(self, owner: str, slots: list[int], block_ids: list[int]) -> HostLoad:
        """Copies the taken `slots` into device blocks `block_ids` (freshly allocated to `owner`, read by nobody
        until this load is reported finished)."""
        assert self._pool is not None and self._slab is not None, "bind() first"
        # Evictions into the slots read here, or out of the blocks written here, go first: gathered and on the copy
        # stream (drained), which the load stream waits for below.
        self._issue()
        self.drain()
        t0 = time.perf_counter()
        runs = copy_runs(slots, block_ids)
        load = HostLoad(owner, list(slots), len(runs))
        stream = self._load_stream
        if stream is not None:
            # The step's stream: whatever it still does with these blocks. The copy stream: evictions writing
            # the slots read here, or reading the blocks written here (allocating them may have just evicted).
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            assert self._copy_stream is not None
            stream.wait_stream(self._copy_stream)
            load.start = torch.cuda.Event(enable_timing=True)
            load.end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                load.start.record(stream)
                for slot, block, n in runs:
                    self._pool[block:block + n].copy_(self._slab[slot:slot + n], non_blocking=True)
                load.end.record(stream)
        else:
            for slot, block, n in runs:
                self._pool[block:block + n].copy_(self._slab[slot:slot + n])
        self.load_seconds += time.perf_counter() - t0
        self._loads.append(load)
        return load

    def _copied(self, load: HostLoad) -> bool:
        """Whether the load's copies are done (never waits)."""
        return load.end is None or load.end.query()

    def finished_loads(self) -> list[HostLoad]:
        """The loads whose copies finished since the last call (never waits): their slots are released and their
        time and bytes counted."""
        done: list[HostLoad] = []
        pending: list[HostLoad] = []
        for load in self._loads:
            (done if self._copied(load) else pending).append(load)
        self._loads = pending
        for load in done:
            self._settle(load)
        return done

    def _settle(self, load: HostLoad) -> None:
        if load.start is not None and load.end is not None:
            self.load_device_seconds += load.start.elapsed_time(load.end) / 1e3
            assert self._pool is not None
            # A no-op on the GPU once the event is done; keeps the forward that reads these blocks in stream order.
            torch.cuda.current_stream(self._pool.device).wait_event(load.end)
        self.release(load.slots)
        self.loaded_blocks += len(load.slots)
        self.loaded_bytes += len(load.slots) * self.block_bytes
        self.load_copies += load.num_copies

    def _abandon_loads(self) -> None:
        """Waits for the loads nobody will poll any more (the engine that issued them is gone) and settles them."""
        for load in self._loads:
            if load.end is not None:
                load.end.synchronize()
            self._settle(load)
        self._loads = []

    @property
    def load_time(self) -> float:
        """Seconds the loads took: on CUDA their GPU time (those reported finished), on CPU the host's (copies
        are plain)."""
        return self.load_device_seconds if self._pin else self.load_seconds

    def clear(self) -> int:
        """Drops every entry (routers hear BlockRemoved for each); the number dropped. Slots a load still reads
        return to the free list when it is reported finished."""
        n = len(self._blocks)
        hashes = [h for _, h in self._blocks.values() if h is not None]
        for slot, _ in self._blocks.values():
            if slot in self._reading:
                self._free_after_load.add(slot)
            else:
                self._free_slots.append(slot)
        self._blocks.clear()
        if self.events is not None and hashes:
            self.events.host_removed(hashes)
        return n
