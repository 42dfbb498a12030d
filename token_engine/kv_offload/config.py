"""vLLM's offload settings -> the host tier's size, with vLLM's meaning.

- ``--kv-offloading-size GiB`` with ``--kv-offloading-backend native`` (vLLM's default backend);
- ``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"cpu_bytes_to_use": N, "block_size": B}}'``.

The host tier stores blocks of the engine's ``--block-size``; an OffloadingConnector ``block_size`` must equal it.
"""

from __future__ import annotations

from typing import Any

import msgspec

GIB = 1 << 30
OFFLOADING_CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
BACKENDS = ("native", "lmcache")


class OffloadingExtraConfig(msgspec.Struct, frozen=True):
    """The keys that decide what is stored; vLLM's tuning keys (store_threshold, blocks_per_chunk...) are
    accepted and change nothing here."""

    cpu_bytes_to_use: int | None = None
    block_size: int | None = None
    spec_name: str = "CPUOffloadingSpec"
    eviction_policy: str = "lru"


def host_tier_bytes(kv_transfer_config: dict[str, Any] | None, offloading_size_gib: float | None,
                    backend: str | None, block_size: int, block_bytes: int) -> int | None:
    """The host tier's capacity in bytes, or None when no offload is configured. Bad settings: ValueError."""
    size: int | None = None
    if offloading_size_gib is not None:
        if backend not in (None, "native"):
            raise ValueError(f"--kv-offloading-backend {backend!r}: only 'native' (host memory) is served here")
        if offloading_size_gib <= 0:
            raise ValueError("--kv-offloading-size must be positive (GiB)")
        size = int(offloading_size_gib * GIB)
        if size < block_bytes:
            raise ValueError(f"--kv-offloading-size holds no block of {block_bytes} bytes")
    elif backend is not None and backend not in BACKENDS:
        raise ValueError(f"--kv-offloading-backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if kv_transfer_config and kv_transfer_config.get("kv_connector") in OFFLOADING_CONNECTORS:
        if size is not None:
            raise ValueError("give the host tier's size once: --kv-offloading-size or OffloadingConnector")
        try:
            extra = msgspec.convert(kv_transfer_config.get("kv_connector_extra_config") or {}, OffloadingExtraConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"OffloadingConnector kv_connector_extra_config: {e}") from None
        if extra.spec_name != "CPUOffloadingSpec" or extra.eviction_policy != "lru":
            raise ValueError("OffloadingConnector: only the CPU spec with LRU eviction is served here")
        if extra.block_size is not None and extra.block_size != block_size:
            raise ValueError(f"OffloadingConnector block_size {extra.block_size} must equal --block-size {block_size}")
        if extra.cpu_bytes_to_use is None:
            raise ValueError("OffloadingConnector needs cpu_bytes_to_use in kv_connector_extra_config")
        size = extra.cpu_bytes_to_use
        if size < block_bytes:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use holds no block of {block_bytes} bytes")
    return size


def without_offloading_connector(kv_transfer_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The connector config left for the P/D connector once the offload tier has taken its own entry."""
    if kv_transfer_config and kv_transfer_config.get("kv_connector") in OFFLOADING_CONNECTORS:
        return None
    return kv_transfer_config
