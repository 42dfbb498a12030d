"""``PerTokenizer``: one cache per tokenizer, which the render configurations of that tokenizer share.

A configuration asks for its cache with its share of ``--render-cache-bytes`` (budget.py); the largest bound asked
for holds. The tokenizer is kept alive beside its cache, so that its ``id`` names it alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from render_service.caches.byte_lru import ByteLRU

V = TypeVar("V")


class PerTokenizer(Generic[V]):
    """``keep(tokenizer, max_bytes)`` makes or widens a tokenizer's cache, ``of(tokenizer)`` finds it."""

    def __init__(self, make: Callable[[], V], lru_of: Callable[[V], ByteLRU[Any, Any]], entry_divisor: int) -> None:
        """``make``: a new cache (bounded at 0 bytes until kept); ``lru_of``: the ``ByteLRU`` that bounds it;
        ``entry_divisor``: its largest entry is its bound over this."""
        self._make = make
        self._lru_of = lru_of
        self._entry_divisor = entry_divisor
        self._caches: dict[int, tuple[object, V]] = {}
        self._lock = threading.Lock()

    def keep(self, tokenizer: object, max_bytes: int) -> V | None:
        """``tokenizer``'s cache, bounded by the largest ``max_bytes`` asked for (0 asks for none); None where
        none was asked for."""
        with self._lock:
            cache = self.of(tokenizer)
            if max_bytes > 0:
                if cache is None:
                    cache = self._make()
                    self._caches[id(tokenizer)] = (tokenizer, cache)
                lru = self._lru_of(cache)
                lru.max_bytes = max(lru.max_bytes, max_bytes)
                lru.max_entry_bytes = lru.max_bytes // self._entry_divisor
            return cache

    def of(self, tokenizer: object) -> V | None:
        found = self._caches.get(id(tokenizer))
        return found[1] if found is not None and found[0] is tokenizer else None
