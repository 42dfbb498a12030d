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
    kv_transfer_config = split_connectors(kv_transfer_config)[1]
    if kv_transfer_config is not None:
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


MULTI_CONNECTOR = "MultiConnector"


def split_connectors(kv_transfer_config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the P/D connector's config, the offload tier's config) of a ``--kv-transfer-config``. vLLM's
    ``MultiConnector`` lists its connectors under ``kv_connector_extra_config.connectors``: here at most one
    offloading connector and one other; a sub-config without ``kv_role`` or ``engine_id`` takes the outer one's."""
    if not kv_transfer_config:
        return None, None
    name = kv_transfer_config.get("kv_connector")
    if name in OFFLOADING_CONNECTORS:
        return None, kv_transfer_config
    if name != MULTI_CONNECTOR:
        return kv_transfer_config, None
    subs = (kv_transfer_config.get("kv_connector_extra_config") or {}).get("connectors")
    if not isinstance(subs, list) or not subs or not all(isinstance(c, dict) for c in subs):
        raise ValueError("MultiConnector needs kv_connector_extra_config.connectors: a list of connector configs")
    inherited = {k: kv_transfer_config[k] for k in ("kv_role", "engine_id") if k in kv_transfer_config}
    offload = [c for c in subs if c.get("kv_connector") in OFFLOADING_CONNECTORS]
    others = [{**inherited, **c} for c in subs if c.get("kv_connector") not in OFFLOADING_CONNECTORS]
    if len(offload) > 1 or len(others) > 1 or any(c.get("kv_connector") == MULTI_CONNECTOR for c in others):
        raise ValueError("MultiConnector: at most one offloading connector and one P/D connector here")
    return (others[0] if others else None), (offload[0] if offload else None)
