"""Who owns KV blocks: allocation, reference counts and prefix caching by block hash.

A block's hash chains its parent's hash with its token ids (and, for the first block, the request's
cache_salt), so two sequences share a cached block only if their whole prefix up to it is identical.
Blocks whose reference count drops to zero go back on the free list but keep their hash: they can be
hit again until allocation evicts them (least recently freed first). `num_free_blocks()` therefore counts
evictable cached blocks as free and returns to `num_blocks` whenever no sequence holds a block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from token_engine.core.sequence import Sequence

if TYPE_CHECKING:
    from token_engine.kv_events.recorder import KVEventRecorder
    from token_engine.kv_offload.host_tier import HostKVTier, HostLoad


def hash_block(parent_hash: bytes | None, token_ids: list[int], cache_salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is None:
        # Only the first block carries the salt; the chain carries it to every later block.
        h.update(b"root:" + (cache_salt or "").encode("utf-8") + b"\x00")
    else:
        h.update(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Free blocks in eviction order (oldest first); O(1) removal when a cached free block is hit.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Metrics: prompt tokens looked up in / found in the prefix cache.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Lookups past the device tier (host tier, a P/D peer): vLLM's "external" prefix cache, and the prompt
        # tokens each tier served at admission (vLLM's sources: device, host, p2p, disk, external_unspecified).
        self.external_queries = 0
        self.external_hits = 0
        self.cached_by_source: dict[str, int] = {}
        # KV events for routers (--kv-events-config): None when off, and then nothing below does extra work.
        self.events: KVEventRecorder | None = None
        # The host-memory tier below the device pool (--kv-offloading-size): evicted cached blocks go there.
        self.host: HostKVTier | None = None

    # ---- accounting -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing ----------------------------------------------------------------------------------
    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of seq.token_ids."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.cache_salt))

    # ---- prefix cache -----------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of seq, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size  # the last token must run to give logits
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_offloaded_prefix(self, seq: Sequence, start: int) -> list[bytes]:
        """Hashes of the blocks after seq's first `start` (the device hits) that the host tier holds, in order,
        leaving at least one token to compute."""
        if self.host is None or not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in seq.block_hashes[start:max_blocks]:
            if not self.host.contains(h):
                break
            hits.append(h)
        return hits

    def load_from_host(self, seq: Sequence, keys: list[bytes], num_more_tokens: int) -> HostLoad | None:
        """Gives seq blocks for the host tier's `keys` (right after its device hits, which it holds) and for
        `num_more_tokens` after them, and starts copying the keys' KV into the first ones. None, and no change,
        when the blocks are not there. The loaded tokens count as computed, and their blocks are published, only
        once the load is reported finished (the scheduler keeps seq out of steps until then)."""
        assert self.host is not None and keys
        slots = self.host.take(keys)  # before allocate: the evictions it causes offload blocks, and must not drop these
        start = len(seq.block_table)
        if not self.allocate(seq, len(keys) * self.block_size + num_more_tokens):
            self.host.release(slots)
            return None
        # The new blocks hold nothing yet: ordering them as the slots are makes runs of slots land in runs of blocks
        # (one copy each).
        end = start + len(keys)
        for pos, block_id in zip(sorted(range(len(keys)), key=slots.__getitem__), sorted(seq.block_table[start:end])):
            seq.block_table[start + pos] = block_id
        return self.host.load(seq.seq_id, slots, seq.block_table[start:end])

    def can_admit(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether cached_blocks can be taken and num_new_tokens more tokens get room."""
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)  # hits that sit on the free list
        total = len(cached_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_needed(total) - len(cached_blocks)
        return needed <= len(self.free) - reclaimed

    def take_cached_blocks(self, seq: Sequence, cached_blocks: list[int]) -> None:
        assert not seq.block_table, "cached prefix is taken once, on an empty block table"
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        seq.num_published_blocks = len(cached_blocks)

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens
        self._count_source("device", num_hit_tokens)

    def record_external_lookup(self, num_queried_tokens: int, hits_by_source: dict[str, int]) -> None:
        self.external_queries += num_queried_tokens
        for source, n in hits_by_source.items():
            self.external_hits += n
            self._count_source(source, n)

    def _count_source(self, source: str, num_tokens: int) -> None:
        if num_tokens:
            self.cached_by_source[source] = self.cached_by_source.get(source, 0) + num_tokens

    # ---- allocation -------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq room for num_new_tokens past its computed tokens; False (and no change) if out of blocks."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free):
            return False
        for _ in range(max(needed, 0)):
            block_id, _ = self.free.popitem(last=False)
            old = self.block_hash[block_id]
            if old is not None:  # evict the stale cache entry
                indexed = self.cached.get(old) == block_id
                if indexed:
                    del self.cached[old]
                self.block_hash[block_id] = None
                event_hash = self.events.block_evicted(block_id, indexed) if self.events is not None else None
                if indexed and self.host is not None:  # its KV is still intact: keep a copy in host memory
                    self.host.offload(old, block_id, event_hash)
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of seq's blocks that are full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if n_full <= seq.num_published_blocks:  # most decode steps: no block filled up
            return
        self.update_block_hashes(seq)
        events = self.events
        hashed: list[int] = []
        indexed: list[int] = []
        for i in range(seq.num_published_blocks, n_full):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is not None:
                continue
            h = seq.block_hashes[i]
            self.block_hash[block_id] = h
            # an identical block may already be cached: keep the first
            if self.cached.setdefault(h, block_id) == block_id and events is not None:
                indexed.append(i)
            if events is not None:
                hashed.append(i)
        if events is not None and hashed:
            events.blocks_hashed(seq, hashed, indexed)
        seq.num_published_blocks = n_full

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block hash (blocks in use keep their KV; nobody new can hit them); the number
        of index entries dropped."""
        dropped = len(self.cached)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.events is not None:
            self.events.cleared()
        return dropped

    def free_blocks(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody holds go to the free list, tail last (freed later = evicted later)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is None:
                    # Uncached blocks are worthless: reuse them first.
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)
                else:
                    self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
