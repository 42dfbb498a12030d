"""Multi-turn KV reuse by ``conversation_id`` (disaggregated mode), as vLLM's multi-turn P/D proxy.

With ``bidirectional_kv_xfer`` on both engine pools, decode ends each turn holding the turn's KV (prompt +
output) for ``decoder_kv_blocks_ttl`` and returns its ``kv_transfer_params`` on the final stream event. The
gateway keeps them per conversation; the next turn's prefill gets them with ``do_remote_decode`` set, pulls
the held blocks from decode and computes only the new tokens. The engine checks the new prompt extends the
held tokens exactly (``remote_token_hash``) and recomputes otherwise, so a rewritten history (reasoning
dropped by the template) costs a recompute, never a wrong answer (vllm#43094).

The cache is per gateway process: single use (taken when the next turn starts, so two concurrent turns of
one conversation never pull one lease twice), LRU-bounded, and entries expire before decode drops the
blocks. ``conversation_id`` is untrusted: it is length-checked and only its hash is kept.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from render_service.http.errors import bad_request
from splitserve_common.limits import kv_transfer_params_violation

logger = logging.getLogger("render_service.gateway.conversations")

MAX_CONVERSATION_ID_CHARS = 256
CONVERSATION_HEADER = "x-conversation-id"
# vLLM's proxy keeps entries 450 s against the engines' default decoder_kv_blocks_ttl of 480 s: the margin
# covers the prefill's queueing before its read starts.
DEFAULT_TTL_S = 450.0
DEFAULT_CAPACITY = 10_000

TURNS = Counter("splitserve_gateway_conversation_turns_total",
                "Disaggregated turns that carried a conversation_id, by what became of decode's held KV "
                "(hit: sent to prefill; miss: none held; expired: held too long; fallback: prefill failed "
                "with it and recomputed).", ["outcome"])
HELD = Counter("splitserve_gateway_conversation_held_total",
               "Decode end-of-turn kv_transfer_params kept for a conversation's next turn, by outcome "
               "(stored, evicted by the size bound, refused as malformed).", ["outcome"])


@dataclass(frozen=True)
class HeldTurn:
    """What decode holds after a conversation's last turn, and where."""

    kv_transfer_params: dict
    decode_url: str
    expires_at: float


def conversation_key(body_id: str | None, headers: Mapping[str, str]) -> bytes | None:
    """The cache key of a request's conversation: the body's ``conversation_id`` (vLLM's proxy) or the
    ``X-Conversation-Id`` header (which an L7 load balancer can also hash on to keep a conversation on one
    gateway replica). Both given and different: 400. Empty: none."""
    header_id = headers.get(CONVERSATION_HEADER)
    if body_id and header_id and body_id != header_id:
        raise bad_request("conversation_id and the X-Conversation-Id header differ", "conversation_id")
    value = body_id or header_id
    if not value:
        return None
    if len(value) > MAX_CONVERSATION_ID_CHARS:
        raise bad_request(f"conversation_id is at most {MAX_CONVERSATION_ID_CHARS} characters", "conversation_id")
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def next_turn_prefill_params(held: HeldTurn) -> dict:
    """Decode's held params turned into a prefill request's: pull from decode, then hold for the next decode."""
    return {**held.kv_transfer_params, "do_remote_decode": True, "do_remote_prefill": False}


class ConversationCache:
    """conversation key -> HeldTurn: single use, at most ``capacity`` entries (least recently stored go
    first), each kept ``ttl_s`` seconds."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 0 or not ttl_s >= 0 or math.isinf(ttl_s):
            raise ValueError("conversation cache: capacity >= 0 and a finite ttl >= 0 seconds")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, HeldTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.ttl_s > 0

    def take(self, key: bytes) -> HeldTurn | None:
        """The conversation's held turn, removed (single use); None when absent or expired."""
        held = self._entries.pop(key, None)
        if held is None:
            TURNS.labels("miss").inc()
            return None
        if self._clock() >= held.expires_at:
            TURNS.labels("expired").inc()
            return None
        TURNS.labels("hit").inc()
        return held

    def put(self, key: bytes, kv_transfer_params: object, decode_url: str) -> bool:
        """Keep decode's end-of-turn params for the next turn (replacing an older turn's)."""
        if not self.enabled:
            return False
        if not isinstance(kv_transfer_params, dict) or not kv_transfer_params.get("remote_block_ids") \
                or kv_transfer_params_violation(kv_transfer_params) is not None:
            HELD.labels("refused").inc()
            return False
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = HeldTurn(dict(kv_transfer_params), decode_url, now + self.ttl_s)
        HELD.labels("stored").inc()
        self._evict(now)
        return True

    def _evict(self, now: float) -> None:
        # Oldest first: expired entries, then whatever exceeds the bound (entries share one TTL, so
        # insertion order is expiry order).
        while self._entries:
            key, held = next(iter(self._entries.items()))
            if held.expires_at > now and len(self._entries) <= self.capacity:
                return
            del self._entries[key]
            if held.expires_at > now:
                HELD.labels("evicted").inc()


def preferred_replica(pool, url: str, tried: set[str]):
    """The replica that served the conversation's last decode, if it is still in the pool, healthy, not
    tried yet and under the pool's load bound: its prefix cache still holds the conversation's blocks,
    so the next decode pulls only the new tokens from prefill. Otherwise None (choose by load)."""
    now = time.monotonic()
    replica = next((r for r in pool.replicas if r.url == url), None)
    if replica is None or url in tried or not replica.healthy(now):
        return None
    total = sum(r.outstanding for r in pool.replicas)
    cap = math.ceil(pool.load_factor * (total + 1) / len(pool.replicas))
    return replica if replica.outstanding + 1 <= cap else None


def prefill_fell_back(call, rid: str, url: str, exc: Exception) -> str:
    """A prefill that was to pull the conversation's KV failed (decode gone, lease expired, refused): the
    caller recomputes on the same replica under a new engine request id, which this returns."""
    TURNS.labels("fallback").inc()
    logger.info("request %s: prefill could not reuse the conversation's KV (%s); recomputing", rid, exc)
    call.live.pop(rid, None)
    rid = f"{rid}-recompute"
    call.live[rid] = url
    return rid
