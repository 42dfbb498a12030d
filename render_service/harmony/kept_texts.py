"""Harmony message texts' ids, kept by the text, one cache per tokenizer.

A Harmony prompt encodes each message text on its own (harmony/render.py), so a text's ids are the same wherever it
sits and a conversation's earlier texts, resent every turn, need not be encoded again. The cache is set up by the
render configuration from ``--render-cache-bytes`` (caches/budget.py) and read by the renderer; the configurations
of one tokenizer share it, the largest bound asked for holding.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from render_service.caches.byte_lru import ByteLRU

# tokenizer id -> (the tokenizer, kept alive so that its id names it alone, and its cache)
_KEPT: dict[int, tuple[object, ByteLRU[str, Sequence[int]]]] = {}
_LOCK = threading.Lock()


def keep_texts(tokenizer: object, max_bytes: int) -> ByteLRU[str, Sequence[int]] | None:
    """The cache of ``tokenizer``'s message texts, bounded by the largest ``max_bytes`` asked for (0 asks for
    none); None where none was asked for."""
    with _LOCK:
        kept = kept_texts(tokenizer)
        if max_bytes > 0:
            if kept is None:
                kept = ByteLRU(max_bytes)
                _KEPT[id(tokenizer)] = (tokenizer, kept)
            kept.max_bytes = max(kept.max_bytes, max_bytes)
            kept.max_entry_bytes = kept.max_bytes // 8
        return kept


def kept_texts(tokenizer: object) -> ByteLRU[str, Sequence[int]] | None:
    found = _KEPT.get(id(tokenizer))
    return found[1] if found is not None and found[0] is tokenizer else None
