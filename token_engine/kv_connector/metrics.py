"""KV transfer metrics: the first thing an operator checks when P/D time-to-first-token looks wrong.

Prometheus names follow vLLM's NixlConnector (`vllm:nixl_*`) so existing dashboards work. The periodic
"KV transfer" log line summarises the last interval; it is emitted from `poll()`, so no extra thread.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Histogram

log = logging.getLogger("token_engine.kv_transfer")

XFER_SECONDS = Histogram(
    "vllm:nixl_xfer_time_seconds", "KV handoff READ time, post to completion",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
XFER_BYTES = Histogram(
    "vllm:nixl_bytes_transferred", "Bytes per KV handoff READ",
    buckets=tuple(float(1 << k) for k in range(16, 34, 2)))
XFER_DESCRIPTORS = Histogram(
    "vllm:nixl_num_descriptors", "NIXL descriptors per KV handoff READ (after merging consecutive blocks)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 512, 4096))
XFER_FAILURES = Counter("vllm:nixl_num_failed_transfers", "Failed KV handoffs", ["reason"])
LEASES_EXPIRED = Counter("splitserve:kv_leases_expired_total", "Prefill leases that expired unread")
STALE_READS = Counter("splitserve:kv_stale_reads_total",
                      "Decode READs refused because the lease had ended (blocks may have been recycled)")


class TransferLog:
    """Counts transfers and writes one summary line per interval, only when something happened."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
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
        XFER_SECONDS.observe(seconds)
        XFER_BYTES.observe(nbytes)
        XFER_DESCRIPTORS.observe(descriptors)
        self.count += 1
        self.bytes += nbytes
        self.descriptors += descriptors
        self.seconds.append(seconds)

    def record_failure(self, reason: str) -> None:
        XFER_FAILURES.labels(reason=reason).inc()
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
