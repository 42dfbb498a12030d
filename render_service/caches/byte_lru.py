"""``ByteLRU``: a mapping bounded by the estimated bytes of what it holds, least recently used dropped first.

Every render cache is one (the piece cache, the message memo, the ``tojson`` texts) or files its values in one, so
each has the same bound, lock and counters, and the budget (budget.py) reads them all alike. The caller estimates
an entry's size (it knows what the value holds); one entry larger than ``max_entry_bytes`` is not kept, so a
single huge value cannot flush everything else.

Keys must be built-in values (str, bytes, int, tuples of them) whose hash and comparison run no Python code: a
hit then takes no lock (``dict.get`` and ``move_to_end`` are each one step under the GIL, and an entry another
thread evicts in between is simply not moved). Writes and evictions take the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class CacheStats(NamedTuple):
    """What /metrics shows of one cache (budget.py)."""

    hits: int
    misses: int
    evictions: int
    bytes: int
    max_bytes: int
    entries: int


class ByteLRU(Generic[K, V]):
    """``key -> value`` holding at most ``max_bytes`` of the callers' estimates."""

    def __init__(self, max_bytes: int, *, max_entry_bytes: int | None = None, max_entries: int | None = None,
                 on_evict: Callable[[V], None] | None = None) -> None:
        """``max_entry_bytes``: the largest entry kept (default: an eighth of the bound); ``on_evict``: called
        with each value dropped, under the cache's lock (keep it short); ``max_entries``: a bound on the count too."""
        if max_bytes < 0:
            raise ValueError("a cache's size must be >= 0 bytes")
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_bytes // 8 if max_entry_bytes is None else max_entry_bytes
        self.on_evict = on_evict
        self.max_entries = max_entries
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value kept under ``key`` (now the most recently used), else None; counted as a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: still the value it held
            pass
        self.hits += 1
        return entry[0]

    def peek(self, key: K) -> V | None:
        """The value kept under ``key``, else None; neither counted nor made the most recently used."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, size: int, *, replace: bool = False) -> bool:
        """Keeps ``value`` under ``key`` unless ``size`` is past ``max_entry_bytes``; a key kept already keeps its
        first value (callers put only values equal to what they would compute) unless ``replace`` (the old one is
        then dropped as an eviction is, ``on_evict`` included). True if kept."""
        return self.put_many([(key, value, size)], replace=replace) == 1

    def put_many(self, items: list[tuple[K, V, int]], *, replace: bool = False) -> int:
        """``put`` of each (key, value, size) under one lock; how many were kept."""
        entries = self._entries
        limit = self.max_entry_bytes
        kept = 0
        with self._lock:
            for key, value, size in items:
                if size > limit:
                    continue
                old = entries.get(key)
                if old is not None:
                    if not replace:
                        continue
                    del entries[key]
                    self.bytes -= old[1]
                    if self.on_evict is not None:
                        self.on_evict(old[0])
                entries[key] = (value, size)
                self.bytes += size
                kept += 1
            self._shrink()
        return kept

    def pop(self, key: K) -> V | None:
        """Drops ``key``'s entry (no ``on_evict``: the caller has it); its value, else None."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self.bytes -= entry[1]
            return entry[0]

    def take(self, key: K) -> V | None:
        """Checks ``key``'s entry out: drops it and returns its value (a hit), else None (a miss). Two threads
        taking one key cannot both get its value."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                self.misses += 1
                return None
            self.bytes -= entry[1]
            self.hits += 1
            return entry[0]

    def drop_oldest_while(self, stale: Callable[[V], bool]) -> None:
        """Drops entries from the least recently used end while ``stale(value)`` holds (an expiry: where values
        are only put and taken, that end holds the oldest); counted as evictions."""
        entries = self._entries
        with self._lock:
            while entries:
                key, (value, size) = next(iter(entries.items()))
                if not stale(value):
                    break
                del entries[key]
                self.bytes -= size
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(value)

    def _shrink(self) -> None:
        """Drops the least recently used entries past the bound (the lock held)."""
        entries = self._entries
        most = len(entries) if self.max_entries is None else self.max_entries
        while (self.bytes > self.max_bytes or len(entries) > most) and entries:
            _, (value, size) = entries.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(value)

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.evictions, self.bytes, self.max_bytes, len(self._entries))
