"""One engine's KV handoff: the prefill half (handoff_producer: leases, side channel, pushes) and the decode
half (handoff_consumer: loads and peers) over one NIXL agent, independent of the scheduler. Everything
advances in `poll()`; nothing here blocks the engine loop.

While a load is in flight a small poller thread drives progress tightly (waits on the links' sockets, at
most TIGHT_POLL_S between READ checks), so a READ that finishes during a long forward step is confirmed at
once and the engine learns of it at its next poll (`wait_for_outcome` lets an idle loop wake early). While
only leases are held it runs every LEASE_POLL_S. One lock serialises every NIXL call (the agent is created
without NIXL's own locking) and both halves' state, and everything observed is queued for the engine's next
`poll()`.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from token_engine.kv_connector.handoff_consumer import HandoffConsumer
from token_engine.kv_connector.handoff_producer import READER_NOTIFICATIONS, HandoffProducer
from token_engine.kv_connector.handoff_types import HandoffPoll, RemoteKV
from token_engine.kv_connector.leases import KVLease, LeaseTable, parse_notification
from token_engine.kv_connector.metrics import TransferLog
from token_engine.kv_connector.nixl_transport import KVTransferError, NixlTransport, ReadResult
from token_engine.kv_connector.peers import AllowedPeers

if TYPE_CHECKING:
    import torch

__all__ = ["KVHandoff"]

log = logging.getLogger("token_engine.kv_transfer")
TIGHT_POLL_S = 0.0001  # between READ checks while a load is in flight
LEASE_POLL_S = 0.002  # while only leases are held: the peer's wire-up and notifications need our progress


class KVHandoff:
    def __init__(self, engine_id: str, kv_pool: torch.Tensor, lease_duration_s: float = 30.0,
                 load_timeout_s: float = 10.0, side_channel_host: str = "127.0.0.1", side_channel_port: int = 0,
                 log_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, fingerprint: str = "", secret: bytes | None = None,
                 allowed_peers: AllowedPeers | None = None, block_size: int = 16,
                 token_hash: Callable[[list[int]], str] | None = None):
        self.engine_id = engine_id
        secret = secret or None
        self.fingerprint = fingerprint
        self._clock = clock
        self._wake = threading.Event()
        self.leases = LeaseTable(lease_duration_s, clock=clock)
        self.transport = NixlTransport(engine_id, kv_pool, clock=clock)
        pub = self.transport.publication(engine_id, self.leases.incarnation)
        pub.fingerprint = fingerprint
        self.stats = TransferLog(log_interval_s, clock)
        self.producer = HandoffProducer(self.transport, self.leases, pub, self.stats, self._wake, block_size,
                                        fingerprint, token_hash, clock, side_channel_host, side_channel_port,
                                        secret)
        self.side_channel = self.producer.side_channel
        self.consumer = HandoffConsumer(self.transport, self.stats, pub, self.leases.incarnation, load_timeout_s,
                                        fingerprint, secret,
                                        allowed_peers if allowed_peers is not None else AllowedPeers(), clock)
        self._pending = HandoffPoll()  # observed by start_load or the poller, handed out by the next poll()
        self._lock = threading.RLock()
        self._outcome_ready = threading.Event()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name="kv-handoff-poller", daemon=True)
        self._poller.start()

    @property
    def incarnation(self) -> int:
        return self.leases.incarnation

    # -- prefill side -----------------------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: list[int], duration_s: float | None = None, token_hash: str = "",
             caller: str | None = None) -> KVLease:
        return self.producer.hold(request_id, block_ids, duration_s, token_hash, caller)

    def release_hold(self, request_id: str, epoch: int) -> KVLease | None:
        return self.producer.release_hold(request_id, epoch)

    def push_source(self, request_id: str, block_ids: list[int], prompt: list[int], computed: int,
                    lease: tuple[str, int] | None = None, aborted: bool = False) -> None:
        """Prefill (push mode): what the request has computed so far; `lease` once it finished and is held."""
        self.producer.push_source(request_id, block_ids, prompt, computed, lease, aborted)

    def drop_source(self, request_id: str) -> None:
        """Prefill (push mode): the request's blocks are freed; nothing more is pushed from them."""
        self.producer.push.drop_source(request_id)

    # -- decode side ------------------------------------------------------------------------------------

    def start_load(self, request_id: str, remote: RemoteKV, local_ids: list[int], first: int = 0) -> None:
        """Begin pulling `remote.block_ids[first:first + len(local_ids)]` into `local_ids` (the claim is all of
        `remote`); the outcome comes from a later `poll()`."""
        with self._lock:
            self.consumer.start_load(request_id, remote, local_ids, first, self._pending)
        self._wake.set()

    def start_push(self, request_id: str, remote: RemoteKV, local_ids: list[int], first: int,
                   num_tokens: int) -> None:
        """Push mode: reserve `local_ids` for prompt blocks [first, ...) of the producer's request
        `remote.request_id` (num_tokens tokens, hash remote.token_hash), register them on its side channel,
        and report the load done when the producer's `pushed` notification arrives."""
        with self._lock:
            self.consumer.start_push(request_id, remote, local_ids, first, num_tokens, self._pending)
        self._wake.set()

    def cancel_load(self, request_id: str) -> None:
        """Abort a load; its outcome still comes from poll() so blocks are freed only once no READ writes them."""
        with self._lock:
            self.consumer.cancel_load(request_id, self._pending)

    def abandon(self, remote: RemoteKV) -> bool:
        """Decode will never load these blocks (request aborted while queued): tell prefill to free them now.
        Best effort: only possible once the peer is known; otherwise the lease expires."""
        return self._notify(remote, "abort")

    def heartbeat(self, remote: RemoteKV) -> bool:
        """Extend a lease while the request waits (e.g. no free blocks yet); best effort. An unknown peer is
        connected in the background (which also spares the later load its first contact) and gets the next one."""
        if self._notify(remote, "HB"):
            return True
        with self._lock:
            if not self._closed and self.consumer.contact(remote):
                self._wake.set()
        return False

    def _notify(self, remote: RemoteKV, kind: str) -> bool:
        with self._lock:
            sent = self.consumer.notify(remote, kind)
        if sent:
            self._wake.set()
        return sent

    def loading(self) -> int:
        return self.consumer.loading()

    def busy(self) -> bool:
        """True while the engine loop should poll about every millisecond."""
        return self.consumer.busy() or self.producer.busy()

    # -- progress ---------------------------------------------------------------------------------------

    def poll(self) -> HandoffPoll:
        """Everything observed since the last call (by this call, start_load or the poller thread)."""
        with self._lock:
            self._progress(self._pending)
            out, self._pending = self._pending, HandoffPoll()
            self._outcome_ready.clear()
        return out

    def wait_for_outcome(self, timeout_s: float) -> bool:
        """Block until the poller has queued a finished load (or timeout): lets an idle loop sleep without
        adding its sleep to the handoff."""
        return self._outcome_ready.wait(timeout_s)

    def _poll_loop(self) -> None:
        if self.transport.layout.mem_type == "VRAM":
            # UCX's cuda_ipc progress runs in this thread: give it the pool's (primary) CUDA context, as
            # NIXL's own progress thread would have.
            import torch

            torch.cuda.set_device(self.transport.layout.device_id)
        while not self._closed:
            if not self.busy():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                if self._closed:
                    return
                try:
                    self._progress(self._pending)
                except Exception:  # noqa: BLE001 - the engine's own poll() will surface persistent errors
                    log.exception("KV handoff poller")
                if self._pending.loads:
                    self._outcome_ready.set()
                loading = self.consumer.loading() > 0
                links = self.consumer.waiting_links()
            if not loading:
                self._wake.wait(LEASE_POLL_S)
                self._wake.clear()
            elif links:
                try:  # an answer on a link wakes us at once; otherwise re-check the READ soon
                    select.select(links, [], [], TIGHT_POLL_S)
                except (OSError, ValueError):
                    pass  # a link closed meanwhile: the next _progress notices
            else:
                time.sleep(TIGHT_POLL_S)

    def _progress(self, out: HandoffPoll) -> None:
        try:
            result = self.transport.poll()
        except KVTransferError as e:
            log.warning("NIXL poll failed: %s", e)
            result = None
        reads: dict[int, ReadResult] = {}
        if result is not None:
            reads = {r.read_id: r for r in result.reads}
            self.consumer.on_reads(reads)
            for agent, msg in result.notifications:
                n = parse_notification(msg)
                if n is None:
                    log.warning("ignoring malformed KV notification from %s", agent)
                elif n.kind in READER_NOTIFICATIONS:
                    self.producer.on_notification(agent, n, out)
                else:
                    self.consumer.on_push_notification(agent, n)
        self.producer.progress_pushes(reads, out)
        self.consumer.progress(out)
        self.producer.expire(out)
        self.stats.maybe_log()

    def close(self) -> list[KVLease]:
        """Stop serving; returns the leases still held so the caller can free their blocks."""
        self._closed = True
        self._wake.set()
        self._poller.join(timeout=5)
        self.producer.close_side_channel()
        self.consumer.shutdown_workers()
        with self._lock:  # a poller slow to notice _closed is not inside NIXL while the agent goes away
            self.consumer.close()
            self.producer.close()
            self.transport.close()
        return self.leases.release_all()
