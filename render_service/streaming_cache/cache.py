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
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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
        self._entries: OrderedDict[tuple[Any, ...], tuple[float, V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0  # what the entries weigh (values plus ENTRY_OVERHEAD_BYTES each)
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: tuple[Any, ...]) -> V | None:
        """Check an entry out (it leaves the cache); None on a miss or when it expired."""
        now = self._clock()
        with self._lock:
            item = self._entries.pop(key, None)
            if item is None:
                self.misses += 1
                return None
            self.bytes -= item[2]
            if now - item[0] > self.ttl_s:
                self.misses += 1
                return None
            self.hits += 1
            return item[1]

    def put(self, key: tuple[Any, ...], value: V) -> None:
        weight = self._weigh(value) + ENTRY_OVERHEAD_BYTES
        now = self._clock()
        with self._lock:
            self._drop(key)
            if weight > self.max_bytes:
                return  # could never fit: the caller's miss path runs instead
            self._entries[key] = (now, value, weight)
            self.bytes += weight
            self._expire(now)
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def discard(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: tuple[Any, ...]) -> None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.bytes -= item[2]

    def _expire(self, now: float) -> None:
        # Oldest first: stop at the first entry still alive (insertion order == age order).
        while self._entries:
            key, (stamp, _, _) = next(iter(self._entries.items()))
            if now - stamp <= self.ttl_s:
                break
            self._drop(key)
            self.evictions += 1
