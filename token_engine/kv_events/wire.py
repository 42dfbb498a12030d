"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``, 0.33-0.34), as msgspec structs.

Field names, order, defaults and struct options are vLLM's, so the msgpack bytes are the bytes vLLM sends and
vLLM's own classes (and llm-d's and Dynamo's decoders) read them. A batch is an array ``[ts, events, dp_rank?]``;
an event is a map tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``. Block hashes are the
low 64 bits of vLLM's prefix-cache hash (``splitserve_common.block_hashes.external_hash``).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's device tier reports GPU whatever the device (its CPU backend included)
MEDIUM_CPU = "CPU"  # the host-memory offload tier
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: (cache_salt,) on a salted first block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
