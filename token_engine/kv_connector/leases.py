"""Prefill-side leases on the KV blocks of finished requests, waiting for decode to read them.

A lease is keyed by (request id, epoch). The epoch is unique per lease and per engine incarnation, so a
notification for an older lease, or one sent to a restarted engine, never frees (or vouches for) blocks
that were recycled: NIXL itself reads recycled memory silently (nixl.md §6).

Notifications (NIXL notification payloads, untrusted):
- `read:<request id>:<epoch>`: attached by decode to its READ, so it arrives only after the bytes were
  copied. Ends the lease and frees the blocks; the lease is remembered as read by that agent, so decode's
  `lease_status` question on the side channel (asked after its READ) can be answered "read".
- `HB:<request id>:<epoch>`: heartbeat while decode is still queued; extends expiry to
  max(old, now + 2/3 lease), as vLLM does.
- `abort:<request id>:<epoch>`: decode gave up on the request before reading; free at once instead of
  waiting for expiry.
A lease that sees neither expires after `kv_lease_duration` seconds and its blocks are freed.

Claims and pinning (side channel `lease_status` with pin_s): before it READs, decode presents its claim, the
block ids and token hash it was given for the lease, and asks to pin it. The producer is the authority:
`claim_mismatch` (the one place a claim is checked, for pull and push modes alike) refuses any claim whose
block ids are not exactly the lease's or whose token hash is not the one prefill computed, so a caller cannot
point a lease of its own at another request's blocks. A matching held lease is then pinned to that reader:
it cannot expire for pinned_s seconds, and only that reader's `read`/`abort` ends it, so a READ posted after
"held" sees the lease's blocks and nothing recycled. A second reader gets "gone".
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_NOTIF_BYTES = 1024
# read/HB/abort: decode -> prefill (pull); pushed/pushfail: prefill -> decode (push mode: the WRITEs into the
# reservation <request id>:<epoch> are complete / will never complete)
NOTIFICATION_KINDS = ("read", "HB", "abort", "pushed", "pushfail")
READ_RECORDS = 8192  # leases ended by a READ that decode may still ask about
MIN_PIN_CAP_S = 60.0  # a pin may outlast the lease duration up to this (decode's load deadline), no longer


@dataclass
class KVLease:
    request_id: str
    epoch: int
    block_ids: list[int]
    expires_at: float
    reader: str = ""  # the decode agent the lease is pinned to, once pinned
    token_hash: str = ""  # which tokens the blocks hold KV for (nixl.token_hash), as prefill computed it
    caller: str | None = None  # who asked for the prefill (lease budgets), None for in-process callers


def claim_mismatch(lease: KVLease, block_ids, token_hash: str) -> str | None:
    """Why a reader's claim on `lease` is refused, or None when it names exactly the lease's blocks and tokens.
    A lease granted without a token hash vouches for nothing and refuses every claim."""
    if not lease.token_hash or not isinstance(token_hash, str) or token_hash != lease.token_hash:
        return "token hash does not match the lease"
    if block_ids is None or list(block_ids) != lease.block_ids:
        return "block ids do not match the lease"
    return None


@dataclass(frozen=True)
class LeaseNotification:
    kind: str  # one of NOTIFICATION_KINDS
    request_id: str
    epoch: int


def new_incarnation() -> int:
    """A random 31-bit engine incarnation; epochs are (incarnation << 32) | counter."""
    return random.SystemRandom().getrandbits(31) | 1


def format_notification(kind: str, request_id: str, epoch: int) -> bytes:
    return f"{kind}:{request_id}:{epoch}".encode()


def parse_notification(msg: bytes) -> LeaseNotification | None:
    """Parse `kind:<request id>:<epoch>`; request ids may contain ':' so split the epoch off the right.
    Returns None for anything malformed (the sender is untrusted)."""
    if len(msg) > MAX_NOTIF_BYTES:
        return None
    try:
        text = msg.decode()
        kind, rest = text.split(":", 1)
        request_id, epoch = rest.rsplit(":", 1)
        if kind not in NOTIFICATION_KINDS or not request_id or not epoch.isdigit():
            return None
        return LeaseNotification(kind, request_id, int(epoch))
    except (UnicodeDecodeError, ValueError):
        return None


class LeaseTable:
    """Leases by (request id, epoch). Freeing is the caller's job: every method that ends a lease returns it.
    Thread-safe: the side channel thread answers `status` while the engine loop grants and ends leases."""

    def __init__(self, duration_s: float = 30.0, incarnation: int | None = None, clock=time.monotonic):
        if duration_s <= 0:
            raise ValueError("kv_lease_duration must be positive")
        self.duration_s = duration_s
        self.incarnation = new_incarnation() if incarnation is None else incarnation
        self._clock = clock
        self._counter = 0
        self._leases: dict[tuple[str, int], KVLease] = {}
        self._read_by: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._lock = threading.Lock()

    def grant(self, request_id: str, block_ids: list[int], duration_s: float | None = None, token_hash: str = "",
              caller: str | None = None) -> KVLease:
        with self._lock:
            self._counter += 1
            epoch = (self.incarnation << 32) | self._counter
            lease = KVLease(request_id, epoch, list(block_ids), self._clock() + (duration_s or self.duration_s),
                            token_hash=token_hash, caller=caller)
            self._leases[(request_id, epoch)] = lease
            return lease

    def on_read(self, request_id: str, epoch: int, reader: str) -> KVLease | None:
        """Decode `reader`'s READ finished: end the lease and remember who read it. None means it had
        already ended (expired, aborted, read before): nothing to free, and `status` will say "gone"."""
        with self._lock:
            lease = self._leases.get((request_id, epoch))
            if lease is not None and lease.reader and lease.reader != reader:
                return None  # pinned to another reader, whose READ may still be running
            lease = self._leases.pop((request_id, epoch), None)
            if lease is not None:
                self._read_by[(request_id, epoch)] = reader
                while len(self._read_by) > READ_RECORDS:
                    self._read_by.popitem(last=False)
            return lease

    def on_heartbeat(self, request_id: str, epoch: int) -> bool:
        with self._lock:
            lease = self._leases.get((request_id, epoch))
            if lease is None:
                return False
            lease.expires_at = max(lease.expires_at, self._clock() + self.duration_s * 2 / 3)
            return True

    def pin(self, request_id: str, epoch: int, reader: str, pin_s: float, block_ids=None,
            token_hash: str = "") -> tuple[str, float]:
        """Check `reader`'s claim (block ids + token hash) and pin a held lease to it for up to pin_s (capped)
        seconds: returns (status, seconds actually pinned). "refused": the lease exists but the claim does not
        match it (nothing changes); pinned to another reader: ("gone", 0)."""
        with self._lock:
            lease = self._leases.get((request_id, epoch))
            if lease is None:
                return ("read" if self._read_by.get((request_id, epoch)) == reader else "gone"), 0.0
            if lease.reader and lease.reader != reader:
                return "gone", 0.0
            if claim_mismatch(lease, block_ids, token_hash) is not None:
                return "refused", 0.0
            if not pin_s > 0:
                return "held", 0.0
            pinned = min(pin_s, max(self.duration_s, MIN_PIN_CAP_S))
            lease.reader = reader
            lease.expires_at = max(lease.expires_at, self._clock() + pinned)
            return "held", pinned

    def status(self, request_id: str, epoch: int, reader: str) -> str:
        """"held": blocks not freed yet; "read": freed by `reader`'s own READ notification; else "gone".
        Asked after a READ completed, "held" or "read" proves the READ saw the lease's blocks."""
        with self._lock:
            lease = self._leases.get((request_id, epoch))
            if lease is not None:
                return "held" if not lease.reader or lease.reader == reader else "gone"
            if self._read_by.get((request_id, epoch)) == reader:
                return "read"
            return "gone"

    def release(self, request_id: str, epoch: int, reader: str | None = None) -> KVLease | None:
        """End a lease early (request aborted by the caller, engine shutting down; `reader`: a decode's
        abort notification, refused while the lease is pinned to another reader)."""
        with self._lock:
            lease = self._leases.get((request_id, epoch))
            if lease is not None and reader is not None and lease.reader and lease.reader != reader:
                return None
            return self._leases.pop((request_id, epoch), None)

    def expire(self) -> list[KVLease]:
        with self._lock:
            now = self._clock()
            gone = [k for k, lease in self._leases.items() if lease.expires_at <= now]
            return [self._leases.pop(k) for k in gone]

    def release_all(self) -> list[KVLease]:
        with self._lock:
            out = list(self._leases.values())
            self._leases.clear()
            return out

    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    def find(self, request_id: str) -> list[KVLease]:
        """The leases held under one request id (abort by id: the caller knows no epoch)."""
        with self._lock:
            return [lease for (rid, _), lease in self._leases.items() if rid == request_id]

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._leases
