"""vLLM's prefix-cache block hashes, computed from token ids exactly as vLLM's engine computes them.

Routers index engines by these hashes (llm-d's precise prefix scorer, Dynamo's KV router read them from KV
events). The render tier can hand them out with the ids it rendered, so a router needs no second tokenizer or
hasher; an engine publishes the same values in its KV events.

vLLM (0.32-0.34, ``v1/core/kv_cache_utils.py``): a full block's hash is ``H((parent, tuple(block_ids), extra))``,
the first block's parent being ``H(seed)``; the seed is $PYTHONHASHSEED, else "vllm-none-hash" for the
cryptographic algorithms (``sha256`` pickles its input, ``sha256_cbor`` encodes it as canonical CBOR). Extra keys
are tagged tuples: ``("lora", name, path)`` on every block of a LoRA request, ``("cache_salt", salt)`` on the
first block. KV events carry a hash as the low 64 bits of its digest read big-endian
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor")


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


class BlockHashConfig(msgspec.Struct, frozen=True):
    """What an engine's hashes depend on: its block size, hash algorithm and seed (vLLM's flag names:
    ``--block-size``, ``--prefix-caching-hash-algo``; the seed is the engine's $PYTHONHASHSEED)."""

    block_size: int = 16
    hash_algo: str = "sha256"
    seed: str | None = None  # None: $PYTHONHASHSEED, else vLLM's default seed

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block size must be positive, not {self.block_size}")
        if self.hash_algo not in HASH_FUNCTIONS:
            # vLLM's xxhash variants use a random per-process seed unless one is shared: a router cannot
            # reproduce them by default, so they are not offered here.
            raise ValueError(f"prefix caching hash algorithm {self.hash_algo!r} is not one of {', '.join(HASH_ALGOS)}")

    def resolved_seed(self) -> str:
        return self.seed if self.seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def block_hashes(token_ids: Sequence[int], config: BlockHashConfig, *, cache_salt: str | None = None,
                 lora: tuple[str, str] | None = None) -> list[bytes]:
    """The hash of every full block of ``token_ids`` (a partial last block has none), chained from the first."""
    fn = HASH_FUNCTIONS[config.hash_algo]
    size = config.block_size
    parent = fn(config.resolved_seed())
    lora_keys: list[tuple[str, ...]] = [("lora", *lora)] if lora else []
    out: list[bytes] = []
    for start in range(0, len(token_ids) - size + 1, size):
        keys = lora_keys + ([("cache_salt", cache_salt)] if start == 0 and cache_salt else [])
        parent = fn((parent, tuple(token_ids[start:start + size]), tuple(keys) if keys else None))
        out.append(parent)
    return out


def external_hash(digest: bytes) -> int:
    """A hash as vLLM's KV events carry it: the low 64 bits of the digest, read big-endian."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)
