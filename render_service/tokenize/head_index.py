"""Recent values filed by the head of a text (or bytes) they belong to, for the stores that find an earlier turn of
a conversation from the next one's head (prompt_prefix_store.py: rendered prompts; wire/body_prefix_store.py: request
bodies).

A value is filed under (c, the ``window`` characters before c) for c = ``base``, 2 * base, 4 * base ... up to its
text's length, so values that share only a short head (a system prompt, the tools) do not crowd one another out; a
lookup tries the largest checkpoint first. A bucket keeps its ``BUCKET`` newest values; least recently used values
are dropped past ``max_bytes`` (the caller's estimate of each), and a value the caller says a newer one replaces is
dropped at once. Per process, shared by the render lanes (one lock); the values themselves are never changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from render_service.caches.byte_lru import ByteLRU, CacheStats

BUCKET = 4
_KEY_OVERHEAD = 150  # a bucket key's tuple, its window's header and a dict slot, besides the window itself

V = TypeVar("V")
Head = TypeVar("Head", str, bytes)


class HeadIndex(Generic[V, Head]):
    def __init__(self, max_bytes: int, base: int, window: int) -> None:
        if max_bytes < 0 or base < 1 or window < 1:
            raise ValueError("a head index needs max_bytes >= 0, base >= 1 and window >= 1")
        self.max_bytes = max_bytes
        self.base = base
        self.window = window
        self.reused = 0  # lookups whose candidates served, since start (``touch``)
        self.lookups = 0  # lookups since start (``candidates``)
        # The values by identity, with the bucket keys each is filed under; an eviction unfiles the value.
        self._values: ByteLRU[int, tuple[V, list[tuple[int, Head]]]] = ByteLRU(
            max_bytes, max_entry_bytes=max_bytes // 4, on_evict=self._unfile)
        self._buckets: dict[tuple[int, Head], list[V]] = {}
        # Guards the buckets. Writes take it before the ByteLRU's own lock, so an eviction's unfiling
        # (on_evict, run under that lock) never races a lookup's read of a bucket.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    @property
    def bytes(self) -> int:
        return self._values.bytes

    @property
    def evictions(self) -> int:
        """Values dropped to stay within ``max_bytes``."""
        return self._values.evictions

    def checkpoints(self, length: int) -> list[int]:
        """base, 2 * base, ... up to ``length``, largest first."""
        points = []
        point = self.base
        while point <= length:
            points.append(point)
            point *= 2
        return points[::-1]

    def _key(self, head: Sequence[str] | Sequence[int], point: int) -> tuple[int, Head]:
        return point, head[max(0, point - self.window):point]  # type: ignore[return-value]

    def candidates(self, head: Head) -> Iterator[list[V]]:
        """The values filed under each checkpoint of ``head`` that matches, largest first (a copy per bucket,
        compared by the caller outside the lock)."""
        self.lookups += 1  # (two lanes may lose a count now and then)
        for point in self.checkpoints(len(head)):
            with self._lock:
                found = list(self._buckets.get(self._key(head, point), ()))
            if found:
                yield found

    def touch(self, value: V) -> None:
        """``value`` served a lookup: the most recently used now."""
        self._values.get(id(value))
        self.reused += 1

    def add(self, value: V, head: Head, size: int, replaces: V | None = None) -> None:
        """Files ``value`` under ``head``'s checkpoints (if it is long enough and ``size``, its estimate, fits in
        a quarter of the bound: one huge value must not flush every other); drops ``replaces`` first."""
        keys = [self._key(head, point) for point in self.checkpoints(len(head))]
        if not keys:
            return
        size += sum(_KEY_OVERHEAD + (len(w) if isinstance(w, bytes) or w.isascii() else 4 * len(w)) for _, w in keys)
        with self._lock:
            if replaces is not None:
                dropped = self._values.pop(id(replaces))
                if dropped is not None:
                    self._unfile(dropped)
            if not self._values.put(id(value), (value, keys), size):
                return
            for key in keys:
                bucket = self._buckets.setdefault(key, [])
                bucket.insert(0, value)
                if len(bucket) > BUCKET:
                    del bucket[BUCKET:]  # still filed under its larger checkpoints

    def _unfile(self, entry: tuple[V, list[tuple[int, Head]]]) -> None:
        value, keys = entry
        for bucket_key in keys:
            bucket = self._buckets.get(bucket_key)
            if bucket is None:
                continue
            bucket[:] = [v for v in bucket if v is not value]
            if not bucket:
                del self._buckets[bucket_key]


class HeadStore(Generic[V, Head]):
    """What a store over a ``HeadIndex`` shows of it: its bound, size, count and reuses."""

    def __init__(self, max_bytes: int, base: int, window: int) -> None:
        self._index: HeadIndex[V, Head] = HeadIndex(max_bytes, base, window)
        self.max_bytes = max_bytes
        self.base = base

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return self._index.bytes

    @property
    def reused(self) -> int:
        """Lookups that found a stored head, since start."""
        return self._index.reused

    def stats(self) -> CacheStats:
        """For the budget's /metrics (caches/budget.py): a lookup that found a stored head is a hit."""
        index = self._index
        return CacheStats(index.reused, max(0, index.lookups - index.reused), index.evictions, index.bytes,
                          self.max_bytes, len(index))
