"""``--kv-events-config``: vLLM's KVEventsConfig keys, with vLLM's defaults and meaning."""

from __future__ import annotations

from typing import Any

import msgspec


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # a wildcard / ipc / inproc address binds, any other connects (as vLLM)
    replay_endpoint: str | None = None  # ROUTER socket: a subscriber asks for batches from a sequence number on
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark: past it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it the engine step drops them
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv events publisher {self.publisher!r} is not one of zmq, null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be positive")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events {name} {value!r} is not a tcp://, ipc:// or inproc:// address")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(raw: dict[str, Any] | None) -> KVEventsConfig | None:
    """The config when events are published, else None (events off cost nothing)."""
    if raw is None:
        return None
    try:
        config = msgspec.convert(raw, KVEventsConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--kv-events-config: {e}") from None
    return config if config.publishes else None
