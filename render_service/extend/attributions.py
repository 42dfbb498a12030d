"""Recent answers' loss-mask attributions, found again by the prompt ids and the conversation that gave them.

An RL rollout asks for masks every turn, and each turn's extend needs the attribution of its previous prompt (which
message each id came from, whether the model sampled it). Rebuilding it re-renders the conversation once per
message, and fails outright (every id unknown) where the sampled turn is not what the template would write,
which is why the extend exists. The previous turn's answer already said it: ``AttributionCache`` keeps each
masked answer's attribution under a digest of its ids, its messages and the template arguments, so the next
turn's extend of exactly that prompt, over exactly those messages, takes it back.

Bounded by bytes (an id's index as 4 bytes, its flag as 1), least recently used dropped first.
"""

from __future__ import annotations

import array
import hashlib
from typing import Any

import msgspec

from render_service.caches.byte_lru import ByteLRU, CacheStats

_ENCODER = msgspec.json.Encoder(enc_hook=repr)  # template arguments may hold values JSON has no type for
_ENTRY_OVERHEAD = 200


def attribution_key(ids: list[int], messages: list[dict[str, Any]], arguments: dict[str, Any]) -> bytes | None:
    """The digest an attribution is filed under; None where the ids cannot be packed (never cached)."""
    try:
        packed = array.array("i", ids)
    except (OverflowError, TypeError):
        return None
    digest = hashlib.blake2b(packed.tobytes(), digest_size=20)
    digest.update(_ENCODER.encode([messages, sorted(arguments.items(), key=lambda item: item[0])]))
    return digest.digest()


class AttributionCache:
    def __init__(self, max_bytes: int) -> None:
        self.lru: ByteLRU[bytes, tuple[array.array[int], bytes]] = ByteLRU(max_bytes)

    def get(self, key: bytes | None) -> tuple[list[int], list[int]] | None:
        found = self.lru.get(key) if key is not None else None
        if found is None:
            return None
        indices, flags = found
        return indices.tolist(), list(flags)

    def put(self, key: bytes | None, indices: list[int], flags: list[int]) -> None:
        if key is None or len(indices) != len(flags):
            return
        try:
            packed = array.array("i", indices), bytes(flags)
        except (OverflowError, ValueError):
            return
        self.lru.put(key, packed, 5 * len(indices) + _ENTRY_OVERHEAD, replace=True)

    def stats(self) -> CacheStats:
        return self.lru.stats()
