"""The engine's KV event stream: the recorder the block manager writes to and the publisher it drains into."""

from __future__ import annotations

import time
from typing import Any

from splitserve_common.block_hashes import BlockHashConfig
from token_engine.kv_events.config import parse_kv_events_config
from token_engine.kv_events.publisher import ZmqEventPublisher
from token_engine.kv_events.recorder import KVEventRecorder
from token_engine.kv_events.wire import KVEventBatch


class KVEventStream:
    def __init__(self, recorder: KVEventRecorder, publisher: ZmqEventPublisher) -> None:
        self.recorder = recorder
        self.publisher = publisher

    def flush(self) -> int:
        """Publishes what the last step recorded as one batch (as vLLM: one batch per step); the events sent."""
        events = self.recorder.take()
        if events:
            # vLLM's publisher stamps its data-parallel rank on every batch: one engine is rank 0
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        return len(events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()


def open_kv_event_stream(raw_config: dict[str, Any] | None, hashes: BlockHashConfig) -> KVEventStream | None:
    """None unless ``--kv-events-config`` enables a zmq publisher."""
    config = parse_kv_events_config(raw_config)
    if config is None:
        return None
    return KVEventStream(KVEventRecorder(hashes), ZmqEventPublisher(config))
