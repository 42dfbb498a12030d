"""The host-memory KV tier: full blocks the device pool evicted, kept for a later prefix hit.

A bounded LRU keyed by the block manager's block hash (which chains the whole prefix and the cache salt, so a hit
is the same tokens in the same context). Entries are copies of one block of the device pool (all layers, K and
V); a hit copies them back into fresh device blocks instead of recomputing the prefix. It is a cache: it holds
nothing a restart needs, and it is emptied whenever it is bound to a pool whose fingerprint (weights, dtype, KV
layout, block size) differs from the one its entries came from.

Blocks live in one host slab allocated when the tier is bound (pinned on CUDA). Copies are issued when the
scheduler evicts or admits, before the step's forward writes the pool. On CUDA an eviction's device-to-host copy
runs on a copy stream of its own, so the host does not wait for it: `fence()` makes what writes the pool next
(the step's forward, a load, a KV transfer from a peer) wait for the copies issued so far, on the GPU where it
can, on the host where the writer does not follow stream order. On CPU copies are plain and immediate.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from token_engine.kv_events.recorder import KVEventRecorder


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
        self._busy: set[bytes] = set()  # taken for a load under way: not dropped until it is done
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: evictions' copies, off the step's stream
        self._copies_pending = False
        self.events: KVEventRecorder | None = None
        # Counters (read by the engine's metrics): blocks and bytes moved each way, time spent moving them.
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.dropped_blocks = 0
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.store_seconds = 0.0
        self.load_seconds = 0.0  # host time to issue the loads (on CUDA they run asynchronously)
        self.load_device_seconds = 0.0  # CUDA: the loads' copy time on the GPU, from events, once they finished
        self._load_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.invalidations = 0

    # ---- binding ----------------------------------------------------------------------------------
    def bind(self, kv_pool: torch.Tensor, fingerprint: str) -> None:
        """Serve `kv_pool` (blocks on dim 0); entries from a pool with another fingerprint are dropped."""
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            self.clear()
            self.invalidations += 1
        self.fingerprint = fingerprint
        self._pool = kv_pool
        self._pin = kv_pool.device.type == "cuda"
        if self._pin and (self._copy_stream is None or self._copy_stream.device != kv_pool.device):
            self._copy_stream = torch.cuda.Stream(kv_pool.device)
        block_shape = tuple(kv_pool.shape[1:])
        self.block_bytes = kv_pool[0].numel() * kv_pool.element_size()
        capacity = self.capacity_bytes // self.block_bytes
        slab = self._slab
        if slab is None or tuple(slab.shape) != (capacity, *block_shape) or slab.dtype != kv_pool.dtype:
            self.clear()  # entries cannot move to a slab of another shape (a changed layout also changed the print)
            self._slab = torch.empty((capacity, *block_shape), dtype=kv_pool.dtype, pin_memory=self._pin)
            self._free_slots = list(range(capacity - 1, -1, -1))
        self.capacity_blocks = capacity

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

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
        t0 = time.perf_counter()
        stream = self._copy_stream
        if stream is not None:
            # after the writes already queued on the step's stream (this block's KV, a load's read of the slot)
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                self._slab[slot].copy_(self._pool[block_id], non_blocking=True)
            self._copies_pending = True
        else:
            self._slab[slot].copy_(self._pool[block_id])
        self.store_seconds += time.perf_counter() - t0  # on CUDA: the time to issue it, what the step waits for
        self._blocks[key] = (slot, event_hash)
        self.stored_blocks += 1
        self.stored_bytes += self.block_bytes
        if self.events is not None and event_hash is not None:
            self.events.host_stored(event_hash)

    def _drop_oldest(self) -> bool:
        victim = next((k for k in self._blocks if k not in self._busy), None)
        if victim is None:
            return False
        slot, event_hash = self._blocks.pop(victim)
        self._free_slots.append(slot)
        self.dropped_blocks += 1
        if self.events is not None and event_hash is not None:
            self.events.host_removed([event_hash])
        return True

    # ---- host -> device ---------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def take(self, keys: list[bytes]) -> None:
        """Marks `keys` (all held) as most recently used and busy until load(): offloads while the device blocks
        for them are allocated cannot drop them."""
        for k in keys:
            self._blocks.move_to_end(k)
        self._busy.update(keys)

    def fence(self, host: bool = False) -> None:
        """What writes the pool next waits for the device-to-host copies issued so far: the current stream on the
        GPU, or (host=True, for writers outside stream order such as a NIXL transfer) the calling thread."""
        stream = self._copy_stream
        if not self._copies_pending or stream is None:
            return
        if host:
            stream.synchronize()
        else:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self._copies_pending = False

    def load(self, keys: list[bytes], block_ids: list[int]) -> None:
        """Copies the taken `keys` into device blocks `block_ids` (freshly allocated, not yet read by any step)."""
        assert self._pool is not None and self._slab is not None, "bind() first"
        self.fence()  # a slot written by a pending eviction copy is read only once that copy is done
        t0 = time.perf_counter()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self._pin else None
        if events is not None:
            events[0].record()
        for key, block_id in zip(keys, block_ids):
            self._pool[block_id].copy_(self._slab[self._blocks[key][0]], non_blocking=self._pin)
        if events is not None:
            events[1].record()
            self._load_events.append(events)
            self.settle_timings()
        self.load_seconds += time.perf_counter() - t0
        self._busy.difference_update(keys)
        self.loaded_blocks += len(block_ids)
        self.loaded_bytes += len(block_ids) * self.block_bytes

    @property
    def load_time(self) -> float:
        """Seconds the loads took: on CUDA their GPU time (those finished), on CPU the host's (copies are plain)."""
        if self._pin:
            self.settle_timings()
            return self.load_device_seconds
        return self.load_seconds

    def settle_timings(self) -> None:
        """Adds the GPU time of the loads that have finished to load_device_seconds (never waits)."""
        pending = []
        for start, end in self._load_events:
            if end.query():
                self.load_device_seconds += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._load_events = pending

    def clear(self) -> int:
        """Drops every entry (routers hear BlockRemoved for each); the number dropped."""
        n = len(self._blocks)
        hashes = [h for _, h in self._blocks.values() if h is not None]
        self._free_slots.extend(slot for slot, _ in self._blocks.values())
        self._blocks.clear()
        self._busy.clear()
        if self.events is not None and hashes:
            self.events.host_removed(hashes)
        return n
