"""Harmony message texts' ids, kept by the text, one cache per tokenizer.

A Harmony prompt encodes each message text on its own (harmony/render.py), so a text's ids are the same wherever it
sits and a conversation's earlier texts, resent every turn, need not be encoded again. The cache is set up by the
render configuration from ``--render-cache-bytes`` (caches/budget.py) and read by the renderer; the configurations
of one tokenizer share it, the largest bound asked for holding.
"""

from __future__ import annotations

from collections.abc import Sequence

from render_service.caches.byte_lru import ByteLRU
from render_service.caches.per_tokenizer import PerTokenizer

_KEPT: PerTokenizer[ByteLRU[str, Sequence[int]]] = PerTokenizer(lambda: ByteLRU(0), lambda lru: lru, 8)


def keep_texts(tokenizer: object, max_bytes: int) -> ByteLRU[str, Sequence[int]] | None:
    """The cache of ``tokenizer``'s message texts, bounded by the largest ``max_bytes`` asked for (0 asks for
    none); None where none was asked for."""
    return _KEPT.keep(tokenizer, max_bytes)


def kept_texts(tokenizer: object) -> ByteLRU[str, Sequence[int]] | None:
    return _KEPT.of(tokenizer)
