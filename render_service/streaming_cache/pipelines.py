"""The pipelines of live streams, kept between their chunks.

A streaming derender call carries its request (tools included) on every chunk, so a pipeline can always be
rebuilt from the call itself. Keeping it spares the build (a few microseconds) on the next chunk of a small
configuration; a large one (long tool lists) costs far more to decode from the call than to build, so it is
not kept at all: a configuration encoded in more than ``MAX_KEPT_CONFIG_BYTES`` is built per chunk. What is
kept is bounded by entries and by the bytes of the kept configurations' encodings (each is held as its key
and as the pipeline's configuration: a small multiple of that in memory).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from render_service.parsers.pipeline import Pipeline, PipelineConfig
from render_service.streaming_cache.codec import binding_for
from render_service.tokenizer import RenderTokenizer

MAX_KEPT_CONFIG_BYTES = 4096
MAX_PIPELINES = 1024
MAX_PIPELINE_BYTES = 1 << 20


class PipelineCache:
    """(Pipeline, state binding) per configuration: an LRU bounded by entries and by encoded bytes. Used from
    the server's event loop only (one thread), like the handlers that call it."""

    def __init__(self, max_entries: int = MAX_PIPELINES, max_bytes: int = MAX_PIPELINE_BYTES,
                 max_config_bytes: int = MAX_KEPT_CONFIG_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_config_bytes = max_config_bytes
        self._entries: OrderedDict[bytes, tuple[Pipeline, bytes, int]] = OrderedDict()
        self.bytes = 0  # the encoded sizes of the kept configurations

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, cfg: PipelineConfig, tokenizer: RenderTokenizer) -> tuple[Pipeline, bytes]:
        """The pipeline for ``cfg`` and the binding of its stream_state (see ``session.binding``)."""
        encoded = msgspec.msgpack.encode(cfg)
        if len(encoded) > self.max_config_bytes:
            return Pipeline(tokenizer, cfg), binding_for(encoded, tokenizer.vocab_size)
        key = encoded + id(tokenizer).to_bytes(8, "little")  # small (see above), and hashed in C
        hit = self._entries.get(key)
        if hit is not None and hit[0].tokenizer is tokenizer:
            self._entries.move_to_end(key)
            return hit[0], hit[1]
        made = Pipeline(tokenizer, cfg), binding_for(encoded, tokenizer.vocab_size)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[2]
        self._entries[key] = (made[0], made[1], len(encoded))
        self.bytes += len(encoded)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1][2]
        return made
