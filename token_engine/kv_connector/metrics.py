"""KV transfer metrics: the first thing an operator checks when P/D time-to-first-token looks wrong.

Prometheus names follow vLLM's NixlConnector (`vllm:nixl_*`) so existing dashboards work. The periodic
"KV transfer" log line summarises the last interval; it is emitted from `poll()`, so no extra thread.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("token_engine.kv_transfer")

class KVTransferMetrics:
    """Prometheus metrics of one connector in its own registry (several engines may share a test process);
    the engine's /metrics appends `render()`."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.xfer_seconds = Histogram(
            "vllm:nixl_xfer_time_seconds", "KV handoff time, READ posted to lease confirmed",
            buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.xfer_bytes = Histogram(
            "vllm:nixl_bytes_transferred", "Bytes per KV handoff READ",
            buckets=tuple(float(1 << k) for k in range(16, 34, 2)), registry=r)
        self.xfer_descriptors = Histogram(
            "vllm:nixl_num_descriptors", "NIXL descriptors per KV handoff READ (after merging consecutive blocks)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 512, 4096), registry=r)
        self.failures = Counter("vllm:nixl_num_failed_transfers", "Failed KV handoffs", ["reason"], registry=r)
        self.leases_expired = Counter("splitserve:kv_leases_expired", "Prefill leases that expired unread",
                                      registry=r)
        self.stale_reads = Counter(
            "splitserve:kv_stale_reads", "Decode READs refused because the lease had ended (blocks may be recycled)",
            registry=r)
        # both modes, by side: pull counts decode's READs; push counts prefill's finished pushes ("prefill":
        # bytes WRITTEN, time from the last WRITE posted to DONE, the part after compute) and decode's landed
        # reservations ("decode": time from reservation to the producer's notification)
        self.handoffs = Counter("splitserve:kv_handoffs", "KV handoffs completed, by mode and side",
                                ["mode", "side"], registry=r)
        self.handoff_bytes = Counter("splitserve:kv_handoff_bytes", "KV bytes handed off, by mode and side",
                                     ["mode", "side"], registry=r)
        self.handoff_seconds = Counter("splitserve:kv_handoff_seconds", "Seconds spent in KV handoffs, by mode "
                                       "and side (see the help of splitserve:kv_handoffs)", ["mode", "side"],
                                       registry=r)
        self.held_blocks = Gauge("splitserve:kv_leased_blocks", "Prefill blocks held for decode under a lease",
                                 registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TransferLog:
    """Counts transfers and writes one summary line per interval, only when something happened."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        self.metrics = KVTransferMetrics()
        self.totals = {"reads": 0, "failures": 0, "bytes": 0, "descriptors": 0, "seconds": 0.0}
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.failures = 0
        self.bytes = 0
        self.descriptors = 0
        self.seconds: list[float] = []

    def record(self, nbytes: int, descriptors: int, seconds: float) -> None:
        m = self.metrics
        m.xfer_seconds.observe(seconds)
        m.xfer_bytes.observe(nbytes)
        m.xfer_descriptors.observe(descriptors)
        self._count("pull", "decode", nbytes, seconds)
        t = self.totals
        t["reads"] += 1
        t["bytes"] += nbytes
        t["descriptors"] += descriptors
        t["seconds"] += seconds
        self.count += 1
        self.bytes += nbytes
        self.descriptors += descriptors
        self.seconds.append(seconds)

    def record_push(self, nbytes: int, seconds: float, side: str, writes: int = 0) -> None:
        self._count("push", side, nbytes, seconds)
        self.totals["push_writes_" + side] = self.totals.get("push_writes_" + side, 0) + writes
        self.totals["pushes_" + side] = self.totals.get("pushes_" + side, 0) + 1
        self.totals["push_bytes_" + side] = self.totals.get("push_bytes_" + side, 0) + nbytes
        self.totals["push_seconds_" + side] = self.totals.get("push_seconds_" + side, 0.0) + seconds

    def _count(self, mode: str, side: str, nbytes: int, seconds: float) -> None:
        m = self.metrics
        m.handoffs.labels(mode=mode, side=side).inc()
        m.handoff_bytes.labels(mode=mode, side=side).inc(nbytes)
        m.handoff_seconds.labels(mode=mode, side=side).inc(seconds)

    def record_failure(self, reason: str) -> None:
        self.metrics.failures.labels(reason=reason).inc()
        self.totals["failures"] += 1
        self.failures += 1

    def summary(self) -> str:
        s = sorted(self.seconds)
        p50 = s[len(s) // 2] * 1e3 if s else 0.0
        p99 = s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3 if s else 0.0
        total_s = sum(s)
        gbps = self.bytes / total_s / 1e9 if total_s > 0 else 0.0
        return (f"KV transfer: {self.count} reads, {self.failures} failed, {self.bytes / 1e6:.1f} MB, "
                f"{self.descriptors} descriptors, p50 {p50:.2f} ms, p99 {p99:.2f} ms, {gbps:.2f} GB/s")

    def maybe_log(self) -> str | None:
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        if not self.count and not self.failures:
            return None
        line = self.summary()
        log.info(line)
        self._reset()
        return line
