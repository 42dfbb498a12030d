"""P/D dispatch helpers: the per-decode-replica prefix record behind conditional disaggregation, and the
decode-side kv_transfer_params of push mode.

Conditional disaggregation: a prompt whose uncached part (by the decode replica's prefix cache) is small
costs less to compute on decode than to prefill elsewhere and hand off. The gateway cannot see decode's
cache, so it estimates it from the prompts it routed to that replica: chained hashes of their full blocks
(as the engine's prefix cache keys them), at most `capacity` per replica, least recently used first out.
An estimate only: the engine may have evicted blocks (then decode computes more than estimated, still
correctly) or hold more (blocks from other gateways).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_RECORD_BLOCKS = 65536  # per replica: 8 bytes of hash each, ~1 M prompt tokens at 16-token blocks


class PrefixRecord:
    def __init__(self, block_size: int, capacity: int = DEFAULT_RECORD_BLOCKS) -> None:
        if block_size < 1 or capacity < 0:
            raise ValueError("prefix record: block size >= 1 and capacity >= 0")
        self.block_size = block_size
        self.capacity = capacity
        self._replicas: dict[str, OrderedDict[bytes, None]] = {}

    def chain(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hash of every full block, each chained to the blocks before it (a block's KV depends on them)."""
        bs, out, prev = self.block_size, [], b""
        for start in range(0, len(token_ids) - bs + 1, bs):
            prev = hashlib.blake2b(prev + struct.pack(f"<{bs}I", *token_ids[start:start + bs]), digest_size=8).digest()
            out.append(prev)
        return out

    def cached_tokens(self, url: str, hashes: list[bytes]) -> int:
        """Leading prompt tokens the replica likely holds KV for."""
        seen = self._replicas.get(url)
        n = 0
        if seen:
            for h in hashes:
                if h not in seen:
                    break
                n += 1
        return n * self.block_size

    def record(self, url: str, hashes: list[bytes]) -> None:
        if not self.capacity:
            return
        seen = self._replicas.setdefault(url, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, url: str) -> None:
        """The replica failed (maybe restarted with an empty cache)."""
        self._replicas.pop(url, None)


def push_decode_params(identity: tuple[str, str, int], prefill_request_id: str) -> dict:
    """Decode's kv_transfer_params in push mode: which prefill engine (side channel) computes the prompt
    under which request id; decode reserves and registers its blocks there."""
    engine_id, host, port = identity
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "remote_request_id": prefill_request_id, "tp_size": 1}


def kv_identity(kv: dict) -> tuple[str, str, int] | None:
    """A prefill replica's KV identity (engine id, side-channel host and port) from its response params."""
    engine_id, host, port = kv.get("remote_engine_id"), kv.get("remote_host"), kv.get("remote_port")
    if isinstance(engine_id, str) and isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
        return engine_id, host, port
    return None
