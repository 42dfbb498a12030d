"""``CacheBudget``: the one owner of ``--render-cache-bytes``, and of what /metrics shows of every render cache.

The bytes are split once, here: the ``tojson`` texts a thirty-second (at most ``tojson_cache.MAX_CACHE_BYTES``),
then of the rest an eighth each for the message memo and its recent bodies (message_memo.py, body_prefix_store.py)
and what remains for the prompt encoder (three quarters piece cache, a quarter prompt store:
incremental_tokenizer.py). Beside that split, not taken from it, each chat template's loop records get an eighth
(templates/loop_resume.py) and the masked answers kept for the next turn's extend a sixteenth (extend/attributions.py),
each at most 64 MiB, the prompts kept under a prompt reference a quarter, at most 512 MiB (extend/prompt_refs.py),
a Harmony model's message texts' ids an eighth, at most 256 MiB (harmony/kept_texts.py), and its renders' turn
records an eighth, at most 64 MiB (harmony/turn_records.py). 0 turns every cache off,
as the reference switch does (reference_mode.py).

Each cache registers how to read its counters (``CacheStats``); ``observe`` turns their growth into the
``splitserve_render_cache_*`` series, at most every ``OBSERVE_EVERY_S`` (a render calls it; a scrape forces it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from render_service.caches.byte_lru import CacheStats

MEMO_SHARE_DIVISOR = 8
TOJSON_SHARE_DIVISOR = 32
LOOP_RECORDS_SHARE_DIVISOR = 8
LOOP_RECORDS_MAX_BYTES = 64 << 20
MASKS_SHARE_DIVISOR = 16
MASKS_MAX_BYTES = 64 << 20
PROMPT_REFS_SHARE_DIVISOR = 4
PROMPT_REFS_MAX_BYTES = 512 << 20
HARMONY_TEXTS_SHARE_DIVISOR = 8
HARMONY_TEXTS_MAX_BYTES = 256 << 20
HARMONY_TURNS_SHARE_DIVISOR = 8
HARMONY_TURNS_MAX_BYTES = 64 << 20
OBSERVE_EVERY_S = 1.0

CACHE_LOOKUPS = Counter("splitserve_render_cache_lookups_total",
                        "Render cache lookups by cache (piece, prompt_store, memo, body_store, tojson, template_loops, "
                        "masks, prompt_refs, harmony_texts, harmony_turns; stream_history, output_texts, images "
                        "outside the budget) and result.",
                        ["cache", "result"])
CACHE_EVICTIONS = Counter("splitserve_render_cache_evictions_total",
                          "Entries a render cache dropped to stay within its bytes.", ["cache"])
CACHE_BYTES = Gauge("splitserve_render_cache_bytes", "Estimated bytes a render cache holds.", ["cache"],
                    multiprocess_mode="livesum")
CACHE_MAX_BYTES = Gauge("splitserve_render_cache_max_bytes",
                        "A render cache's bound: its share of --render-cache-bytes, or its own.", ["cache"],
                        multiprocess_mode="livesum")


@dataclass(frozen=True)
class CacheShares:
    """Bytes per cache out of one total."""

    total: int
    tojson: int
    memo: int
    body_store: int
    prompt_encoder: int  # the piece cache and the prompt store together (IncrementalEncoder splits it)
    template_loops: int = 0  # each chat template's loop records (beside the split)
    masks: int = 0  # the extend's kept attributions (beside the split)
    prompt_refs: int = 0  # prompts kept for the next turn's previous_turn.prompt_ref (beside the split)
    harmony_texts: int = 0  # a Harmony model's message texts' ids (beside the split)
    harmony_turns: int = 0  # a Harmony model's renders' turn records (beside the split)

    @classmethod
    def of(cls, total: int, tojson_cap: int) -> CacheShares:
        if total < 0:
            raise ValueError("--render-cache-bytes must be >= 0")
        tojson = min(tojson_cap, total // TOJSON_SHARE_DIVISOR)
        rest = total - tojson
        memo = rest // MEMO_SHARE_DIVISOR
        return cls(total, tojson, memo, memo, rest - 2 * memo,
                   template_loops=min(LOOP_RECORDS_MAX_BYTES, total // LOOP_RECORDS_SHARE_DIVISOR),
                   masks=min(MASKS_MAX_BYTES, total // MASKS_SHARE_DIVISOR),
                   prompt_refs=min(PROMPT_REFS_MAX_BYTES, total // PROMPT_REFS_SHARE_DIVISOR),
                   harmony_texts=min(HARMONY_TEXTS_MAX_BYTES, total // HARMONY_TEXTS_SHARE_DIVISOR),
                   harmony_turns=min(HARMONY_TURNS_MAX_BYTES, total // HARMONY_TURNS_SHARE_DIVISOR))


@dataclass
class CacheBudget:
    """The shares, and every cache's counters as registered by the code that built it."""

    shares: CacheShares
    _readers: dict[str, Callable[[], CacheStats]] = field(default_factory=dict)
    _seen: dict[str, CacheStats] = field(default_factory=dict)
    _next_observe: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, name: str, read: Callable[[], CacheStats]) -> None:
        self._readers[name] = read

    def stats(self) -> dict[str, CacheStats]:
        return {name: read() for name, read in self._readers.items()}

    def observe(self, force: bool = False) -> None:
        """Adds each cache's new hits, misses and evictions to the counters and sets its bytes."""
        now = time.monotonic()
        if not force and now < self._next_observe:
            return
        with self._lock:
            self._next_observe = now + OBSERVE_EVERY_S
            for name, read in self._readers.items():
                stats = read()
                seen = self._seen.get(name) or CacheStats(0, 0, 0, 0, 0, 0)
                if stats.hits > seen.hits:
                    CACHE_LOOKUPS.labels(cache=name, result="hit").inc(stats.hits - seen.hits)
                if stats.misses > seen.misses:
                    CACHE_LOOKUPS.labels(cache=name, result="miss").inc(stats.misses - seen.misses)
                if stats.evictions > seen.evictions:
                    CACHE_EVICTIONS.labels(cache=name).inc(stats.evictions - seen.evictions)
                CACHE_BYTES.labels(cache=name).set(stats.bytes)
                CACHE_MAX_BYTES.labels(cache=name).set(stats.max_bytes)
                self._seen[name] = stats
