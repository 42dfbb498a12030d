"""Engine replica pools: which replica gets the next request.

A pool is built from URLs. A URL whose host resolves to several addresses (a Kubernetes headless
Service) becomes one replica per address, and the pool re-resolves it periodically, keeping the
outstanding counts of replicas that stay. Choice is least outstanding requests; when the caller has a
prefix key (a hash of the prompt's first blocks), consistent hashing with a load bound picks the
replica that last saw that prefix, so its prefix cache hits, unless that replica already carries more
than ``load_factor`` times the mean load (then the next one on the ring takes it).

A replica that refused a request or dropped its connection is passed over for ``cooldown_s`` (or
until a request elsewhere finds every other replica down too).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import ipaddress
import logging
import math
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger("render_service.gateway.pools")

VIRTUAL_NODES = 64  # ring points per replica: spreads keys evenly over a handful of replicas


@dataclass
class Replica:
    url: str  # base URL, no trailing slash
    source: str  # the configured URL it came from
    outstanding: int = 0
    down_until: float = 0.0
    requests: int = 0
    failures: int = 0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until


@dataclass
class ReplicaPool:
    name: str
    urls: list[str]
    load_factor: float = 1.25
    cooldown_s: float = 5.0
    refresh_interval_s: float = 10.0
    replicas: list[Replica] = field(default_factory=list)
    _ring: list[tuple[int, int]] = field(default_factory=list)  # (point, replica index)
    _ring_points: list[int] = field(default_factory=list)
    _rr: int = 0
    _resolved_at: float = 0.0
    _refreshing: asyncio.Task | None = None
    _all_ips: bool = False  # every URL names an IP address: nothing to re-resolve

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"{self.name} pool needs at least one URL")
        self.set_replicas([(normalize_url(u), normalize_url(u)) for u in self.urls])
        self._all_ips = all(_is_ip(urlsplit(normalize_url(u)).hostname or "") for u in self.urls)

    # membership ----------------------------------------------------------------------------------

    def set_replicas(self, entries: list[tuple[str, str]]) -> None:
        """(url, source) pairs; replicas that stay keep their counters."""
        known = {r.url: r for r in self.replicas}
        self.replicas = [known.get(url) or Replica(url=url, source=source) for url, source in entries]
        ring = []
        for i, r in enumerate(self.replicas):
            for v in range(VIRTUAL_NODES):
                ring.append((_hash64(f"{r.url}#{v}".encode()), i))
        ring.sort()
        self._ring = ring
        self._ring_points = [p for p, _ in ring]

    async def refresh(self, resolver=None) -> None:
        """Re-resolve every configured URL (DNS lookups off the event loop)."""
        resolve = resolver or _resolve
        entries: list[tuple[str, str]] = []
        for source in self.urls:
            base = normalize_url(source)
            parts = urlsplit(base)
            host = parts.hostname or ""
            if _is_ip(host):
                entries.append((base, base))
                continue
            try:
                addresses = await resolve(host, parts.port or (443 if parts.scheme == "https" else 80))
            except OSError as exc:
                logger.warning("%s pool: cannot resolve %s (%s); keeping the last known replicas", self.name, host, exc)
                entries.extend((r.url, r.source) for r in self.replicas if r.source == base)
                continue
            if len(addresses) <= 1:
                entries.append((base, base))  # one address: keep the name (TLS, virtual hosts, keep-alive)
            else:
                entries.extend((_with_host(parts, a), base) for a in addresses)
        if entries:
            self.set_replicas(entries)
        self._resolved_at = time.monotonic()

    def maybe_refresh(self) -> None:
        """Start a background re-resolution when the last one is older than the interval."""
        # (called on every request: the URLs were looked at once, at construction)
        if self.refresh_interval_s <= 0 or self._all_ips:
            return
        if time.monotonic() - self._resolved_at < self.refresh_interval_s:
            return
        if self._refreshing is not None and not self._refreshing.done():
            return
        self._resolved_at = time.monotonic()  # one refresh at a time, even if it fails
        self._refreshing = asyncio.get_running_loop().create_task(self.refresh())

    # choice --------------------------------------------------------------------------------------

    def choose(self, prefix_key: int | None = None, exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The replica for the next request, or None when every replica is excluded."""
        now = time.monotonic()
        candidates = [r for r in self.replicas if r.url not in exclude]
        if not candidates:
            return None
        healthy = [r for r in candidates if r.healthy(now)]
        pool = healthy or candidates  # all down: try one anyway rather than refuse outright
        if prefix_key is not None and len(pool) > 1:
            chosen = self._by_prefix(prefix_key, {r.url for r in pool})
            if chosen is not None:
                return chosen
        return self._least_outstanding(pool)

    def _least_outstanding(self, pool: list[Replica]) -> Replica:
        low = min(r.outstanding for r in pool)
        tied = [r for r in pool if r.outstanding == low]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _by_prefix(self, key: int, allowed: set[str]) -> Replica | None:
        """Consistent hashing with bounded loads: the first replica clockwise under the cap."""
        total = sum(r.outstanding for r in self.replicas if r.url in allowed)
        cap = math.ceil(self.load_factor * (total + 1) / len(allowed))
        start = bisect.bisect_left(self._ring_points, key)
        seen: set[int] = set()
        for step in range(len(self._ring)):
            index = self._ring[(start + step) % len(self._ring)][1]
            if index in seen:
                continue
            seen.add(index)
            r = self.replicas[index]
            if r.url in allowed and r.outstanding + 1 <= cap:
                return r
            if len(seen) == len(self.replicas):
                break
        return None

    # accounting ----------------------------------------------------------------------------------

    def acquire(self, r: Replica) -> None:
        r.outstanding += 1
        r.requests += 1

    def release(self, r: Replica) -> None:
        r.outstanding = max(0, r.outstanding - 1)

    def mark_failed(self, r: Replica) -> None:
        r.failures += 1
        r.down_until = time.monotonic() + self.cooldown_s

    def mark_ok(self, r: Replica) -> None:
        r.down_until = 0.0

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        return [{"url": r.url, "outstanding": r.outstanding, "healthy": r.healthy(now), "requests": r.requests,
                 "failures": r.failures} for r in self.replicas]


def prefix_key(token_ids: Sequence[int], block_size: int, blocks: int) -> int | None:
    """Hash of the first ``blocks`` full blocks of the prompt: what the engine's prefix cache keys on.

    Prompts shorter than one block get no key (nothing cacheable to be near to).
    """
    full = min(blocks, len(token_ids) // block_size)
    if full <= 0:
        return None
    n = full * block_size
    # (the same bytes as each id's to_bytes(4, "little"), packed in one C call instead of a generator)
    return _hash64(struct.pack(f"<{n}I", *token_ids[:n]))


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _with_host(parts, address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0])  # an IPv4/IPv6 address string (typeshed allows an int for other families)
        if address not in seen:
            seen.append(address)
    return seen
