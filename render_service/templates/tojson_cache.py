"""``json.dumps(x, ensure_ascii=False)`` for chat templates' ``tojson``, remembered for values seen before.

Templates write every tool's schema and every earlier tool call's arguments with ``tojson`` on every turn
(~10 µs per KB with the standard library's C encoder; a tenth of a 32k-token agent render). The same values
come back each turn, so their text is kept, keyed by the value's msgpack encoding (msgspec, ~1 µs per KB).

Why the text is the same: a text is given only to a value that has the same key as, and equals, the value it
was written from. The key keeps apart what JSON text could confuse (None and NaN, 1 and 1.0 and True, -0.0
and 0.0, 1 and "1" as keys); equality rules out what msgspec would encode like a plain value but
``json.dumps`` writes otherwise or refuses (a datetime encodes as its ISO string, a set as a list; neither
equals them). What remains, equal under the same key (a list for a tuple, an int enum for its int), is
written the same way by ``json.dumps``. A value msgspec cannot encode (an int past 64 bits, a Jinja object)
is dumped as before, uncached, and an error ``json.dumps`` raises is raised each time, as without the cache.
The values kept are the templates' own copies of request data (chat_template.py builds them fresh per render,
and the sandbox cannot change them).

Values shared between renders (the message memo's prepared tools and tool-call arguments, wire/message_memo.py) are
*lent*: their text is kept by identity while their owner holds them unchanged, and a template's ``tojson`` of
one is a dict lookup (no msgpack key, no equality walk). The owner takes them back (``unlend``) before it lets
go of them, so an identity is never matched to another object.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from render_service.caches.byte_lru import ByteLRU

MAX_CACHE_BYTES = 8 * 1024 * 1024
MAX_KEY_BYTES = 64 * 1024  # larger values are dumped each time (their text would crowd out the rest)

_dumps = json.JSONEncoder(ensure_ascii=False).encode  # HF's tojson with its default options
_key_of = msgspec.msgpack.Encoder().encode


class JsonTextCache:
    """A bytes-bounded LRU of ``json.dumps(x, ensure_ascii=False)`` texts, shared by the render lanes."""

    def __init__(self, max_bytes: int = MAX_CACHE_BYTES) -> None:
        # msgpack key -> (value, text)
        self.lru: ByteLRU[bytes, tuple[Any, str]] = ByteLRU(max_bytes, max_entry_bytes=max_bytes)
        self._lent: dict[int, tuple[Any, str]] = {}  # id(value) -> (value, text), while its owner keeps it as is

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def max_bytes(self) -> int:
        return self.lru.max_bytes

    @max_bytes.setter
    def max_bytes(self, bound: int) -> None:  # (the budget sets it: budget.py; 0: no text kept)
        self.lru.max_bytes = bound
        self.lru.max_entry_bytes = bound
        with self.lru._lock:
            self.lru._shrink()

    def lend(self, value: Any) -> bool:
        """Keeps ``value``'s text by identity until ``unlend(value)``; its owner must not change it meanwhile.
        False (and nothing kept) when ``json.dumps`` refuses it."""
        try:
            text = self.dumps(value)
        except (TypeError, ValueError, RecursionError):
            return False
        self._lent[id(value)] = (value, text)
        return True

    def unlend(self, value: Any) -> None:
        found = self._lent.get(id(value))
        if found is not None and found[0] is value:
            self._lent.pop(id(value), None)

    def dumps(self, value: Any) -> str:
        lent = self._lent.get(id(value))
        if lent is not None and lent[0] is value:
            self.lru.hits += 1  # (a lent text is a hit too; two lanes may lose a count now and then)
            return lent[1]
        try:
            key = _key_of(value)
        except (TypeError, ValueError, OverflowError, RecursionError):  # msgspec.EncodeError is a ValueError
            return _dumps(value)
        if len(key) > MAX_KEY_BYTES:
            return _dumps(value)
        entry = self.lru.get(key)  # (a hit takes no lock: byte_lru.py)
        if entry is not None:
            return entry[1] if value == entry[0] else _dumps(value)
        text = _dumps(value)
        self.lru.put(key, (value, text), 2 * len(key) + (len(text) if text.isascii() else 4 * len(text)) + 200)
        return text

    @property
    def bytes(self) -> int:  # (last: a property named ``bytes`` would hide the type from the annotations above)
        return self.lru.bytes


# HF's default options (``tojson`` without arguments), shared by every template of the process.
DEFAULT_TEXTS = JsonTextCache()
