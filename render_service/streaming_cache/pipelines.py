"""The pipelines of live streams, kept between their chunks.

A streaming derender call carries its request (tools included) on every chunk, so a pipeline can always be
rebuilt from the call itself. Keeping it spares the build (a few microseconds) on the next chunk of a small
configuration; a large one (long tool lists) costs far more to decode from the call than to build, so it is
not kept at all: a configuration encoded in more than ``MAX_KEPT_CONFIG_BYTES`` is built per chunk. What is
kept is bounded by entries and by the bytes of the kept configurations' encodings (each is held as its key
and as the pipeline's configuration: a small multiple of that in memory).
"""

from __future__ import annotations

from render_service.caches.byte_lru import ByteLRU
from render_service.parsers.pipeline import Pipeline, PipelineConfig, config_bytes
from render_service.streaming_cache.codec import binding_for
from render_service.tokenize.tokenizer import RenderTokenizer

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
        # key -> (pipeline, binding), sized by the encoded configuration (caches/byte_lru.py)
        self.lru: ByteLRU[bytes, tuple[Pipeline, bytes]] = ByteLRU(max_bytes, max_entry_bytes=max_config_bytes,
                                                                   max_entries=max_entries)

    def __len__(self) -> int:
        return len(self.lru)

    def get(self, cfg: PipelineConfig, tokenizer: RenderTokenizer) -> tuple[Pipeline, bytes]:
        """The pipeline for ``cfg`` and the binding of its stream_state (see ``session.binding``)."""
        encoded = config_bytes(cfg)
        if len(encoded) > self.max_config_bytes:
            return Pipeline(tokenizer, cfg), binding_for(encoded, tokenizer.vocab_size)
        key = encoded + id(tokenizer).to_bytes(8, "little")  # small (see above), and hashed in C
        hit = self.lru.get(key)
        if hit is not None and hit[0].tokenizer is tokenizer:
            return hit
        made = Pipeline(tokenizer, cfg), binding_for(encoded, tokenizer.vocab_size)
        self.lru.put(key, made, len(encoded), replace=True)
        return made

    @property
    def bytes(self) -> int:  # the encoded sizes of the kept configurations (last: it would hide the type above)
        return self.lru.bytes
