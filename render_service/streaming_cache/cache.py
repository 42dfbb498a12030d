"""Live pipeline states for callers that send vLLM's history-carrying ``stream_state``.

Such a caller re-sends every output token on every chunk; rebuilding the parsers from that history is
O(history) per chunk. Here the state a chunk ends with is kept under the key the *next* chunk will carry
(request id, choice index, tokens so far, a hash of those tokens, the configuration binding), so the next
chunk continues in O(chunk). A miss (another replica, eviction, expiry, a retried chunk) rebuilds the
state once by replaying the history in its original chunks; output is identical either way.

Entries are checked out on use (removed from the cache), so two concurrent uses of one key cannot share a
mutable state: the second simply misses and replays.

The cache is bounded by entries and by bytes: a value weighs its length (encoded states; another ``weigh``
for other values) plus a fixed allowance for the key and bookkeeping; keys are digests, so a client's long
request id is not kept.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from render_service.caches.byte_lru import ByteLRU, CacheStats

# What one entry costs besides its value: the key tuple, its digest, the OrderedDict node, the stamp.
ENTRY_OVERHEAD_BYTES = 256


def history_key(request_id: str, choice_index: int, binding: bytes, token_ids: list[int]) -> tuple[Any, ...]:
    """Key of the state after ``token_ids``: one digest of the request id, the choice and a C array of the ids
    (cheap to hash, and a fixed 16 bytes however long the client's id is)."""
    try:
        raw = array("q", token_ids).tobytes()
    except (OverflowError, TypeError):
        raw = repr(token_ids).encode()
    h = hashlib.blake2b(digest_size=16)
    h.update(request_id.encode(errors="surrogatepass"))
    h.update(b"\x00%d\x00" % choice_index)
    h.update(raw)
    return (binding, len(token_ids), h.digest())


V = TypeVar("V")


def _length(value: Any) -> int:
    return len(value)


class StreamingCache(Generic[V]):
    """A bounded LRU with a time-to-live; values are encoded pipeline states (bytes), or whatever ``weigh``
    (a value's weight in bytes, cheap: it runs on every put) knows how to weigh."""

    def __init__(self, max_entries: int = 4096, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 max_bytes: int = 32 << 20, weigh: Callable[[V], int] = _length):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._weigh = weigh
        # (stamp, value) by key. Entries are only put and taken, never moved, so the least recently used end
        # holds the oldest stamps and expiry stops at the first live one.
        self._entries: ByteLRU[tuple[Any, ...], tuple[float, V]] = ByteLRU(
            max_bytes, max_entry_bytes=max_bytes, max_entries=max_entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the entries weigh (values plus ENTRY_OVERHEAD_BYTES each)."""
        return self._entries.bytes

    @property
    def hits(self) -> int:
        return self._entries.hits

    @property
    def misses(self) -> int:
        return self._entries.misses

    @property
    def evictions(self) -> int:
        """Entries dropped for room or expired."""
        return self._entries.evictions

    def stats(self) -> CacheStats:
        return self._entries.stats()

    def take(self, key: tuple[Any, ...]) -> V | None:
        """Check an entry out (it leaves the cache); None on a miss or when it expired."""
        self._expire()
        item = self._entries.take(key)
        return None if item is None else item[1]

    def put(self, key: tuple[Any, ...], value: V) -> None:
        weight = self._weigh(value) + ENTRY_OVERHEAD_BYTES
        self._entries.pop(key)  # a value that cannot fit must not leave the older one behind either
        self._entries.put(key, (self._clock(), value), weight)  # too heavy: the caller's miss path runs instead
        self._expire()

    def discard(self, key: tuple[Any, ...]) -> None:
        self._entries.pop(key)

    def _expire(self) -> None:
        oldest_alive = self._clock() - self.ttl_s
        self._entries.drop_oldest_while(lambda item: item[0] < oldest_alive)
