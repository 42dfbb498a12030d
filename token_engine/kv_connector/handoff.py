"""Both halves of a KV handoff for one engine, independent of the scheduler: prefill holds blocks under
leases and serves its side channel; decode fetches the peer's publication, READs the blocks, confirms the
lease, and reports the outcome. Everything advances in `poll()`; nothing here blocks the engine loop
(side-channel round trips run on a small worker pool and are collected by `poll()`).

A load goes: fetching peer (first contact or restarted peer) -> reading (NIXL READ, own deadline) ->
confirming (side channel `lease_status`) -> done. Any failure ends it with a reason; the caller applies
kv_load_failure_policy.

While anything is in flight a small poller thread drives the same progress every 0.5 ms, so a READ that
finishes during a long forward step is confirmed before the step ends and the engine learns of it at the
next step boundary instead of one step later. One lock serialises every NIXL call (the agent is created
without NIXL's own locking), and everything observed is queued for the engine's next `poll()`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from token_engine.kv_connector.leases import KVLease, LeaseTable, format_notification, parse_notification
from token_engine.kv_connector.metrics import TransferLog
from token_engine.kv_connector.nixl_transport import KVTransferError, NixlTransport
from token_engine.kv_connector.side_channel import (
    SideChannelError, SideChannelServer, fetch_lease_status, fetch_publication)

log = logging.getLogger("token_engine.kv_transfer")
CONSUMED_MEMORY = 8192


@dataclass(frozen=True)
class RemoteKV:
    """What decode knows about blocks held by a prefill engine (from kv_transfer_params, untrusted)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    epoch: int
    block_ids: tuple[int, ...]

    @property
    def incarnation(self) -> int:
        return self.epoch >> 32


@dataclass
class LoadOutcome:
    request_id: str  # the local (decode) request id
    ok: bool
    error: str = ""
    reason: str = ""
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0


@dataclass
class HandoffPoll:
    freed: list[KVLease] = field(default_factory=list)  # prefill: leases whose blocks may now be freed
    loads: list[LoadOutcome] = field(default_factory=list)  # decode: loads that finished or failed


@dataclass
class _Load:
    request_id: str
    remote: RemoteKV
    local_ids: list[int]
    started: float
    deadline: float
    state: str = "fetching"
    peer: str = ""
    read_id: int = 0
    future: Future | None = None
    bytes: int = 0
    descriptors: int = 0
    cancelled: bool = False


class KVHandoff:
    def __init__(self, engine_id: str, kv_pool, lease_duration_s: float = 30.0, load_timeout_s: float = 10.0,
                 side_channel_host: str = "127.0.0.1", side_channel_port: int = 0, log_interval_s: float = 10.0,
                 clock=time.monotonic):
        self.engine_id = engine_id
        self.load_timeout_s = load_timeout_s
        self._clock = clock
        self.leases = LeaseTable(lease_duration_s, clock=clock)
        self.transport = NixlTransport(engine_id, kv_pool, clock=clock)
        self.side_channel = SideChannelServer(
            self.transport.publication(engine_id, self.leases.incarnation), self.leases.status,
            host=side_channel_host, port=side_channel_port)
        self.stats = TransferLog(log_interval_s, clock)
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-side-channel-client")
        self._loads: dict[str, _Load] = {}
        self._peer_by_addr: dict[tuple[str, int], tuple[str, int]] = {}  # (host, port) -> (agent, incarnation)
        self._consumed: dict[tuple[str, int], None] = {}  # (remote request id, epoch) already loaded here
        self._pending = HandoffPoll()  # observed by start_load or the poller, handed out by the next poll()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name="kv-handoff-poller", daemon=True)
        self._poller.start()

    @property
    def incarnation(self) -> int:
        return self.leases.incarnation

    # -- prefill side -----------------------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: list[int], duration_s: float | None = None) -> KVLease:
        lease = self.leases.grant(request_id, block_ids, duration_s)
        self._wake.set()  # the peer's first READ needs our progress (no NIXL progress thread)
        return lease

    def release_hold(self, request_id: str, epoch: int) -> KVLease | None:
        return self.leases.release(request_id, epoch)

    # -- decode side ------------------------------------------------------------------------------------

    def start_load(self, request_id: str, remote: RemoteKV, local_ids: list[int]) -> None:
        """Begin pulling `remote`'s blocks into `local_ids`; the outcome comes from a later `poll()`."""
        with self._lock:
            self._start_load(request_id, remote, local_ids)
        self._wake.set()

    def _start_load(self, request_id: str, remote: RemoteKV, local_ids: list[int]) -> None:
        if request_id in self._loads:
            raise KVTransferError(f"request {request_id} already loading", "bad_request")
        if len(local_ids) != len(remote.block_ids):
            raise KVTransferError(f"{len(remote.block_ids)} remote blocks for {len(local_ids)} local blocks",
                                  "bad_request")
        if (remote.request_id, remote.epoch) in self._consumed:
            # A second READ of one lease could see recycled blocks that the first READ already freed.
            raise KVTransferError("these remote blocks were already loaded once", "bad_request")
        now = self._clock()
        load = _Load(request_id, remote, list(local_ids), now, now + self.load_timeout_s)
        known = self._peer_by_addr.get((remote.host, remote.port))
        self._loads[request_id] = load
        if known is not None and known[1] == remote.incarnation:
            load.peer = known[0]
            self._post_read(load, self._pending)
        else:
            load.future = self._workers.submit(fetch_publication, remote.host, remote.port)

    def cancel_load(self, request_id: str) -> None:
        """Abort a load; its outcome still comes from poll() so blocks are freed only once no READ writes them."""
        with self._lock:
            load = self._loads.get(request_id)
            if load is not None:
                load.cancelled = True

    def abandon(self, remote: RemoteKV) -> bool:
        """Decode will never load these blocks (request aborted while queued): tell prefill to free them now.
        Best effort: only possible once the peer is known; otherwise the lease expires."""
        known = self._peer_by_addr.get((remote.host, remote.port))
        if known is None or known[1] != remote.incarnation:
            return False
        try:
            with self._lock:
                self.transport.send_notif(known[0], format_notification("abort", remote.request_id, remote.epoch))
            return True
        except KVTransferError:
            return False

    def heartbeat(self, remote: RemoteKV) -> None:
        """Extend a lease while the request waits (e.g. no free blocks yet); best effort."""
        known = self._peer_by_addr.get((remote.host, remote.port))
        if known is not None and known[1] == remote.incarnation:
            try:
                with self._lock:
                    self.transport.send_notif(known[0], format_notification("HB", remote.request_id, remote.epoch))
            except KVTransferError as e:
                log.warning("heartbeat to %s failed: %s", known[0], e)

    def loading(self) -> int:
        return len(self._loads)

    def busy(self) -> bool:
        """True while the engine loop should poll about every millisecond."""
        return bool(self._loads) or len(self.leases) > 0

    # -- progress ---------------------------------------------------------------------------------------

    def poll(self) -> HandoffPoll:
        """Everything observed since the last call (by this call, start_load or the poller thread)."""
        with self._lock:
            self._progress(self._pending)
            out, self._pending = self._pending, HandoffPoll()
        return out

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
            # loads are latency-critical; held leases only need the peer's wire-up and notifications moving
            time.sleep(0.0005 if self._loads else 0.002)

    def _progress(self, out: HandoffPoll) -> None:
        try:
            result = self.transport.poll()
        except KVTransferError as e:
            log.warning("NIXL poll failed: %s", e)
            result = None
        if result is not None:
            reads = {r.read_id: r for r in result.reads}
            for load in list(self._loads.values()):
                r = reads.get(load.read_id) if load.state == "reading" else None
                if r is None:
                    continue
                if not r.ok:
                    self._fail(load, out, r.error, r.reason)
                    if r.reason == "disconnect":
                        self._forget_peer(load.peer)
                    continue
                load.bytes, load.descriptors = r.bytes, r.descriptors
                load.state = "confirming"
                rem = load.remote
                load.future = self._workers.submit(
                    fetch_lease_status, rem.host, rem.port, rem.request_id, rem.epoch, self.transport.agent_name)
            for agent, msg in result.notifications:
                self._on_notification(agent, msg, out)
        for load in list(self._loads.values()):
            self._advance(load, out)
        for lease in self.leases.expire():
            self.stats.metrics.leases_expired.inc()
            log.info("KV lease expired unread: request %s epoch %d (%d blocks freed)",
                     lease.request_id, lease.epoch, len(lease.block_ids))
            out.freed.append(lease)
        self.stats.metrics.held_blocks.set(self.leases.held_blocks())
        self.stats.maybe_log()

    def _on_notification(self, agent: str, msg: bytes, out: HandoffPoll) -> None:
        n = parse_notification(msg)
        if n is None:
            log.warning("ignoring malformed KV notification from %s", agent)
        elif n.kind == "read":
            lease = self.leases.on_read(n.request_id, n.epoch, agent)
            if lease is not None:
                out.freed.append(lease)
        elif n.kind == "HB":
            self.leases.on_heartbeat(n.request_id, n.epoch)
        elif n.kind == "abort":
            lease = self.leases.release(n.request_id, n.epoch)
            if lease is not None:
                out.freed.append(lease)

    def _advance(self, load: _Load, out: HandoffPoll) -> None:
        now = self._clock()
        if load.state == "fetching" and load.future is not None and load.future.done():
            try:
                pub, layout = load.future.result()
                if pub.engine_id != load.remote.engine_id:
                    raise KVTransferError(f"side channel serves engine {pub.engine_id!r}, expected "
                                          f"{load.remote.engine_id!r}", "bad_peer")
                if pub.incarnation != load.remote.incarnation:
                    # The engine restarted since it granted this lease: its blocks are gone.
                    raise KVTransferError("prefill engine restarted since the lease was granted", "stale")
                load.peer = self.transport.add_peer(pub, layout)
                self._peer_by_addr[(load.remote.host, load.remote.port)] = (load.peer, pub.incarnation)
            except (SideChannelError, KVTransferError) as e:
                self._fail(load, out, str(e), getattr(e, "reason", "side_channel"))
                return
            if load.cancelled:
                self._send_abort(load)
                self._fail(load, out, "cancelled", "cancelled")
                return
            self._post_read(load, out)
        elif load.state == "confirming" and load.future is not None and load.future.done():
            try:
                status = load.future.result()
            except SideChannelError as e:
                self._fail(load, out, f"could not confirm the lease: {e}", "side_channel")
                return
            if status == "gone":
                self.stats.metrics.stale_reads.inc()
                self._fail(load, out, "lease ended before the READ completed: blocks may have been recycled",
                           "stale")
                return
            self._loads.pop(load.request_id)
            self._remember_consumed(load.remote)
            if load.cancelled:
                out.loads.append(LoadOutcome(load.request_id, False, "cancelled", "cancelled"))
                return
            seconds = now - load.started
            self.stats.record(load.bytes, load.descriptors, seconds)
            out.loads.append(LoadOutcome(load.request_id, True, bytes=load.bytes, descriptors=load.descriptors,
                                         seconds=seconds))
            return
        if load.request_id in self._loads and now > load.deadline and load.state != "reading":
            # reading has its own deadline inside the transport; fetching/confirming are bounded here
            self._fail(load, out, f"KV load did not finish within {self.load_timeout_s:.1f} s", "timeout")

    def _post_read(self, load: _Load, out: HandoffPoll) -> None:
        rem = load.remote
        try:
            load.read_id = self.transport.start_read(
                load.peer, load.local_ids, list(rem.block_ids), format_notification("read", rem.request_id, rem.epoch),
                max(0.001, load.deadline - self._clock()))
            load.state = "reading"
        except KVTransferError as e:
            self._fail(load, out, str(e), e.reason)
            if e.reason == "disconnect":
                self._forget_peer(load.peer)

    def _send_abort(self, load: _Load) -> None:
        """Tell prefill we will never read, so it frees the blocks now rather than at lease expiry."""
        try:
            self.transport.send_notif(load.peer, format_notification("abort", load.remote.request_id, load.remote.epoch))
        except KVTransferError as e:
            log.info("abort notification to %s failed (lease will expire): %s", load.peer, e)

    def _fail(self, load: _Load, out: HandoffPoll, error: str, reason: str) -> None:
        self._loads.pop(load.request_id, None)
        self.stats.record_failure(reason)
        log.warning("KV load for %s from %s failed (%s): %s", load.request_id, load.remote.engine_id, reason, error)
        out.loads.append(LoadOutcome(load.request_id, False, error, reason, seconds=self._clock() - load.started))

    def _forget_peer(self, agent: str) -> None:
        self.transport.remove_peer(agent)
        for addr, (name, _) in list(self._peer_by_addr.items()):
            if name == agent:
                del self._peer_by_addr[addr]

    def _remember_consumed(self, remote: RemoteKV) -> None:
        self._consumed[(remote.request_id, remote.epoch)] = None
        while len(self._consumed) > CONSUMED_MEMORY:
            del self._consumed[next(iter(self._consumed))]

    def close(self) -> list[KVLease]:
        """Stop serving; returns the leases still held so the caller can free their blocks."""
        self._closed = True
        self._wake.set()
        self._poller.join(timeout=5)
        self.side_channel.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # a poller slow to notice _closed is not inside NIXL while the agent goes away
            self.transport.close()
        return self.leases.release_all()
