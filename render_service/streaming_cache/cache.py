"""Live pipeline states for callers that send vLLM's history-carrying ``stream_state``.

Such a caller re-sends every output token on every chunk; rebuilding the parsers from that history is
O(history) per chunk. Here the state a chunk ends with is kept under the key the *next* chunk will carry
(request id, choice index, tokens so far, a hash of those tokens, the configuration binding), so the next
chunk continues in O(chunk). A miss (another replica, eviction, expiry, a retried chunk) rebuilds the
state once by replaying the history in its original chunks; output is identical either way.

Entries are checked out on use (removed from the cache), so two concurrent uses of one key cannot share a
mutable state: the second simply misses and replays.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


def history_key(request_id: str, choice_index: int, binding: bytes, token_ids: list[int]) -> tuple[Any, ...]:
    """Key of the state after ``token_ids``: hashing a C array of the ids keeps this cheap."""
    try:
        raw = array("q", token_ids).tobytes()
    except (OverflowError, TypeError):
        raw = repr(token_ids).encode()
    digest = hashlib.blake2b(raw, digest_size=16).digest()
    return (request_id, choice_index, binding, len(token_ids), digest)


class StreamingCache:
    """A bounded LRU with a time-to-live; values are opaque (pipeline states)."""

    def __init__(self, max_entries: int = 4096, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[Any, ...], tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: tuple[Any, ...]) -> Any | None:
        """Check an entry out (it leaves the cache); None on a miss or when it expired."""
        now = self._clock()
        with self._lock:
            item = self._entries.pop(key, None)
            if item is None or now - item[0] > self.ttl_s:
                self.misses += 1
                return None
            self.hits += 1
            return item[1]

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        now = self._clock()
        with self._lock:
            self._entries[key] = (now, value)
            self._entries.move_to_end(key)
            self._expire(now)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def discard(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _expire(self, now: float) -> None:
        # Oldest first: stop at the first entry still alive (insertion order == age order).
        while self._entries:
            key, (stamp, _) = next(iter(self._entries.items()))
            if now - stamp <= self.ttl_s:
                break
            del self._entries[key]
            self.evictions += 1
