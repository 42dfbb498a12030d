"""The decode half of a KV handoff: loads remote blocks into local ones, pulled (READ) or pushed (the producer
WRITEs into a reservation), keeping one side-channel link and NIXL agent per prefill peer.

A pulled load goes: fetching peer (first contact, restarted peer, or a closed link: publication + a kept-open
side-channel link, on a worker thread) -> verifying -> reading -> done. Verifying presents our claim (every
block id and the token hash we were given) and asks the peer to pin the lease to us over the open link; the
producer is the authority and answers "held" (pinned) only when the claim is exactly its lease
(leases.claim_mismatch), "refused" otherwise. Only then is the NIXL READ posted (own deadline, never past the
pin), so no byte of a block the lease does not hold is ever read. The load is done when the READ is DONE:
the blocks hold KV the producer vouched for, for exactly these tokens. Peer metadata, the NIXL remote agent
and the link are cached per (host, port) and reused by every later load. Any failure ends a load with a
reason (the caller applies kv_load_failure_policy), but never while its READ may still write into the local
blocks. Not thread-safe by itself: KVHandoff calls it under its one lock.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

from token_engine.kv_connector.descriptors import PoolLayout
from token_engine.kv_connector.handoff_types import HandoffPoll, LoadOutcome, RemoteKV
from token_engine.kv_connector.leases import LeaseNotification, format_notification
from token_engine.kv_connector.metrics import TransferLog
from token_engine.kv_connector.nixl_transport import KVTransferError, NixlTransport, ReadResult
from token_engine.kv_connector.peers import AllowedPeers
from token_engine.kv_connector.side_channel import (
    AgentPublication,
    PeerLink,
    SideChannelError,
    open_link,
)

log = logging.getLogger("token_engine.kv_transfer")
CONSUMED_MEMORY = 8192
PIN_MARGIN_S = 1.0  # the pin outlasts our own load deadline by this much
NOTIF_FLUSH_S = 0.1  # after sending a notification, keep driving progress this long so UCX delivers it

# What a first contact yields on its worker thread: the peer's publication, its pool layout, the open link.
Contact = tuple[AgentPublication, PoolLayout, PeerLink]


class LoadKind(Enum):
    """How the blocks arrive: decode READs them (pull), or the producer WRITEs them into a reservation (push)."""

    PULL = "pull"
    PUSH = "push"


class LoadPhase(Enum):
    """Where a decode-side load is: fetching the peer's publication, verifying our claim, reading (or, in push
    mode, registered and waiting for the producer's WRITEs)."""

    FETCHING = "fetching"
    VERIFYING = "verifying"
    READING = "reading"


@dataclass(frozen=True)
class LoadFailure:
    """Why a load ends unsuccessfully; reported once nothing writes into its blocks any more."""

    error: str
    reason: str


@dataclass
class _Load:
    request_id: str
    remote: RemoteKV
    local_ids: list[int]
    started: float
    deadline: float
    first: int = 0  # the READ covers remote.block_ids[first:first + len(local_ids)] (the rest is cached here)
    kind: LoadKind = LoadKind.PULL
    state: LoadPhase = LoadPhase.FETCHING
    peer: str = ""
    read_id: int = 0
    future: Future[Contact] | None = None
    bytes: int = 0
    descriptors: int = 0
    cancelled: bool = False
    read_done: bool = False  # the READ ended (DONE or failed): nothing writes into local_ids any more
    status: str | None = None  # the peer's answer to our claim
    asked_at: float = 0.0
    pinned_until: float = 0.0  # the peer vouched for the claim and pinned the lease until then
    failure: LoadFailure | None = None  # reported once read_done
    # push mode: decode reserved local_ids under `epoch` for prompt blocks [first, ...) of remote.request_id
    # (num_tokens tokens, remote.token_hash) and waits for the producer's `pushed` notification
    epoch: int = 0
    num_tokens: int = 0
    cancel_sent: bool = False
    answers_due: int = 0  # push: side-channel answers still to come (registration, withdrawal)

    @property
    def push(self) -> bool:
        return self.kind is LoadKind.PUSH

    @property
    def lease(self) -> tuple[str, int]:
        return (self.remote.request_id, self.epoch) if self.push else (self.remote.request_id, self.remote.epoch)


@dataclass
class _Peer:
    """A known prefill peer: its NIXL agent and the kept-open side-channel link, with loads awaiting answers.
    The NIXL remote agent is added only when first needed (a verified READ, a notification): a caller whose
    claims are refused never makes this engine create a UCX endpoint, and an endpoint created and dropped
    unused leaves the peer retrying its connection back to us."""

    agent: str
    incarnation: int
    link: PeerLink
    publication: AgentPublication
    layout: PoolLayout
    added: bool = False
    waiting: dict[tuple[str, int], _Load] = field(default_factory=dict)


class HandoffConsumer:
    def __init__(self, transport: NixlTransport, stats: TransferLog, publication: AgentPublication,
                 incarnation: int, load_timeout_s: float, fingerprint: str, secret: bytes | None,
                 allowed_peers: AllowedPeers, clock: Callable[[], float]):
        self.transport = transport
        self.stats = stats
        self._publication = publication  # sent with push reservations: the producer WRITEs into this agent's pool
        self.incarnation = incarnation
        self.load_timeout_s = load_timeout_s
        self.fingerprint = fingerprint
        self._secret = secret
        self.allowed_peers = allowed_peers
        self._clock = clock
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-side-channel-client")
        self._loads: dict[str, _Load] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}  # (host, port) -> known peer
        self._connecting: dict[tuple[str, int], tuple[RemoteKV, Future[Contact]]] = {}  # background contacts
        self._flush_until = 0.0  # a notification was sent: with no progress thread it moves only when we poll
        self._consumed: dict[tuple[str, int], None] = {}  # (remote request id, epoch) already loaded here
        self._push_loads: dict[tuple[str, int], _Load] = {}  # (prefill request id, our epoch) -> load
        self._push_epochs = itertools.count(1)

    # -- what KVHandoff calls ----------------------------------------------------------------------------

    def start_load(self, request_id: str, remote: RemoteKV, local_ids: list[int], first: int,
                   out: HandoffPoll) -> None:
        if request_id in self._loads:
            raise KVTransferError(f"request {request_id} already loading", "bad_request")
        if not local_ids or first < 0 or first + len(local_ids) > len(remote.block_ids):
            raise KVTransferError(f"{len(local_ids)} local blocks from block {first} of "
                                  f"{len(remote.block_ids)} remote blocks", "bad_request")
        if (remote.request_id, remote.epoch) in self._consumed:
            # A second READ of one lease could see recycled blocks that the first READ already freed.
            raise KVTransferError("these remote blocks were already loaded once", "bad_request")
        addr = (remote.host, remote.port)
        if any(ld.lease == (remote.request_id, remote.epoch) and (ld.remote.host, ld.remote.port) == addr
               for ld in self._loads.values()):
            raise KVTransferError("these remote blocks are already being loaded", "bad_request")
        now = self._clock()
        load = _Load(request_id, remote, list(local_ids), now, now + self.load_timeout_s, first)
        self._loads[request_id] = load
        peer = self._live_peer(addr)
        if peer is not None and peer.incarnation == remote.incarnation:
            self._begin(load, peer, out)
        else:
            load.future = self._connect(remote)

    def start_push(self, request_id: str, remote: RemoteKV, local_ids: list[int], first: int, num_tokens: int,
                   out: HandoffPoll) -> None:
        if request_id in self._loads or not local_ids or first < 0:
            raise KVTransferError(f"request {request_id} already loading or nothing to reserve", "bad_request")
        now = self._clock()
        load = _Load(request_id, remote, list(local_ids), now, now + self.load_timeout_s, first,
                     kind=LoadKind.PUSH, epoch=(self.incarnation << 32) | next(self._push_epochs),
                     num_tokens=num_tokens)
        self._loads[request_id] = load
        self._push_loads[load.lease] = load
        peer = self._live_peer((remote.host, remote.port))
        if peer is not None:
            self._begin(load, peer, out)
        else:
            load.future = self._connect(remote)

    def cancel_load(self, request_id: str, pending: HandoffPoll) -> None:
        load = self._loads.get(request_id)
        if load is not None:
            load.cancelled = True
        # finished by the poller but not handed out yet: report it as cancelled, as the caller now expects
        pending.loads = [LoadOutcome(o.request_id, False, "cancelled", "cancelled", o.bytes, o.descriptors,
                                     o.seconds) if o.request_id == request_id and o.ok else o
                         for o in pending.loads]

    def notify(self, remote: RemoteKV, kind: str) -> bool:
        """Send a lease notification (abort, HB) to a known peer; False if it is unknown or the send failed."""
        peer = self._peers.get((remote.host, remote.port))
        if peer is None or peer.incarnation != remote.incarnation:
            return False
        try:
            self.transport.send_notif(self._agent(peer), format_notification(kind, remote.request_id, remote.epoch))
            self._flush_until = self._clock() + NOTIF_FLUSH_S
            return True
        except KVTransferError as e:
            log.warning("%s notification to %s failed: %s", kind, peer.agent, e)
            return False

    def contact(self, remote: RemoteKV) -> bool:
        """Connect to an unknown peer in the background; True if a contact was started."""
        addr = (remote.host, remote.port)
        if addr in self._peers or addr in self._connecting:
            return False
        self._connecting[addr] = (remote, self._connect(remote))
        return True

    def loading(self) -> int:
        return len(self._loads)

    def busy(self) -> bool:
        return bool(self._loads) or bool(self._connecting) or self._clock() < self._flush_until

    def waiting_links(self) -> list[PeerLink]:
        """The links an answer is awaited on (the poller waits on their sockets)."""
        return [p.link for p in self._peers.values() if p.waiting and not p.link.closed]

    def on_reads(self, reads: dict[int, ReadResult]) -> None:
        for load in list(self._loads.values()):
            r = reads.get(load.read_id) if load.state == LoadPhase.READING and not load.read_done else None
            if r is None:
                continue
            load.read_done = True
            if not r.ok:
                load.failure = load.failure or LoadFailure(r.error, r.reason)
                if r.reason == "disconnect":
                    self._forget_peer(load.peer)
                continue
            load.bytes, load.descriptors = r.bytes, r.descriptors
            self._remember_consumed(load.remote)

    def on_push_notification(self, agent: str, n: LeaseNotification) -> None:
        """pushed / pushfail: only from the producer this reservation was registered with."""
        load = self._push_loads.get((n.request_id, n.epoch))
        if (load is None or load.peer != agent or load.state not in (LoadPhase.VERIFYING, LoadPhase.READING)
                or load.read_done):
            log.warning("ignoring %s notification from %s for a reservation it does not hold", n.kind, agent)
            return
        load.read_done = True
        if n.kind == "pushed":
            load.bytes = len(load.local_ids) * self.transport.layout.geometry.block_bytes
            load.descriptors = 1
        else:
            load.failure = load.failure or LoadFailure("the prefill engine could not push the KV", "push_failed")

    def progress(self, out: HandoffPoll) -> None:
        """Collect side-channel answers and finished contacts, then advance every load."""
        for addr, peer in list(self._peers.items()):
            if peer.waiting:
                self._collect_answers(addr, peer)
        for addr, (remote, future) in list(self._connecting.items()):
            if future.done():
                del self._connecting[addr]
                try:
                    self._adopt(remote, future)
                except (SideChannelError, KVTransferError) as e:
                    log.info("background contact with %s:%d failed: %s", remote.host, remote.port, e)
        for load in list(self._loads.values()):
            self._advance(load, out)

    def shutdown_workers(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        for _, future in self._connecting.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result()[2].close()
        for addr in list(self._peers):
            self._drop_link(addr, "closing")

    # -- internals ---------------------------------------------------------------------------------------

    def _live_peer(self, addr: tuple[str, int]) -> _Peer | None:
        peer = self._peers.get(addr)
        if peer is not None and not peer.link.alive():
            self._drop_link(addr, "side channel closed")
            peer = None
        return peer

    def _connect(self, remote: RemoteKV) -> Future[Contact]:
        return self._workers.submit(open_link, remote.host, remote.port, secret=self._secret,
                                    allowed=self.allowed_peers)

    def _collect_answers(self, addr: tuple[str, int], peer: _Peer) -> None:
        try:
            answers = peer.link.answers()
        except SideChannelError as e:
            self._drop_link(addr, str(e))
            return
        for ans in answers:
            load = peer.waiting.pop((ans.request_id, ans.epoch), None)
            if load is None:
                continue  # the load already ended (cancelled, timed out)
            load.status = ans.status
            if load.push:
                load.answers_due -= 1
                if load.answers_due > 0:  # the withdrawal's answer follows the registration's
                    peer.waiting[load.lease] = load
                self._on_push_answer(load, ans.status)
                continue
            if ans.status == "refused":
                load.failure = load.failure or LoadFailure(
                    "the prefill engine does not hold these blocks for these tokens under this lease", "refused")
            elif ans.status != "held" or ans.pinned_s <= 0:
                # gone (expired, unknown, another reader's) or not pinned: its blocks may be recycled
                self.stats.metrics.stale_reads.inc()
                load.failure = load.failure or LoadFailure(
                    "the lease is no longer held: its blocks may have been recycled", "stale")
            else:
                load.pinned_until = load.asked_at + ans.pinned_s

    def _on_push_answer(self, load: _Load, status: str) -> None:
        if load.cancel_sent and load.answers_due == 0:  # our withdrawal's: "gone" = no WRITE will ever land
            if status == "gone":
                load.read_done = True
        elif load.cancel_sent:
            pass  # the registration's answer; the withdrawal's decides
        elif status == "held":
            load.state = LoadPhase.READING  # registered: the producer WRITEs, then notifies
        else:
            load.read_done = True  # refused: nothing was registered, nothing will be written
            load.failure = load.failure or LoadFailure(
                "the prefill engine refused the reservation (other tokens, a duplicate, or full)", "push_refused")

    def _advance(self, load: _Load, out: HandoffPoll) -> None:
        now = self._clock()
        if load.state == LoadPhase.FETCHING and load.future is not None and load.future.done():
            peer = self._adopt_peer(load, out)
            if peer is None:
                return
            if load.cancelled:
                if not load.push:  # push: nothing registered yet
                    self._send_abort(load)
                self._fail(load, out, LoadFailure("cancelled", "cancelled"))
                return
            self._begin(load, peer, out)
        elif load.push and load.state in (LoadPhase.VERIFYING, LoadPhase.READING) and not load.read_done:
            if load.cancelled and not load.cancel_sent:
                self._withdraw(load)
        elif load.state == LoadPhase.VERIFYING and not load.push:
            if load.failure is not None:
                self._fail(load, out, load.failure)
                return
            if load.pinned_until:
                if load.cancelled:
                    self._send_abort(load)  # pinned to us: let prefill free it now
                    self._fail(load, out, LoadFailure("cancelled", "cancelled"))
                    return
                self._post_read(load, out)
                return
        elif load.read_done and (load.state == LoadPhase.READING or load.push):
            if load.failure is not None:
                self._fail(load, out, load.failure)
                return
            self._loads.pop(load.request_id)
            self._push_loads.pop(load.lease, None)
            if load.cancelled:
                out.loads.append(LoadOutcome(load.request_id, False, "cancelled", "cancelled"))
                return
            seconds = now - load.started
            if load.push:
                self.stats.record_push(load.bytes, seconds, "decode")
            else:
                self.stats.record(load.bytes, load.descriptors, seconds)
            out.loads.append(LoadOutcome(load.request_id, True, bytes=load.bytes, descriptors=load.descriptors,
                                         seconds=seconds))
            return
        if load.request_id in self._loads and now > load.deadline and (
                load.state != LoadPhase.READING or load.read_done or load.push):
            # a running READ has its own deadline inside the transport; fetching/verifying are bounded here
            self._fail(load, out, LoadFailure(f"KV load did not finish within {self.load_timeout_s:.1f} s",
                                              "timeout"))

    def _adopt_peer(self, load: _Load, out: HandoffPoll) -> _Peer | None:
        """First contact (or reconnect) finished: validate the publication, add the NIXL agent, keep the link."""
        future, load.future = load.future, None
        assert future is not None  # _advance adopts only a load whose contact finished
        try:
            return self._adopt(load.remote, future)
        except (SideChannelError, KVTransferError) as e:
            detail = e.detail if isinstance(e, SideChannelError) else str(e)  # the operator's view
            log.warning("KV peer %s:%s for %s: %s", load.remote.host, load.remote.port, load.request_id, detail)
            self._fail(load, out, LoadFailure(str(e), e.reason))
            return None

    def _adopt(self, remote: RemoteKV, future: Future[Contact]) -> _Peer:
        link = None
        try:
            pub, layout, link = future.result()
            if pub.engine_id != remote.engine_id:
                raise KVTransferError(f"side channel serves engine {pub.engine_id!r}, expected "
                                      f"{remote.engine_id!r}", "bad_peer")
            if remote.epoch and pub.incarnation != remote.incarnation:
                # The engine restarted since it granted this lease: its blocks are gone.
                raise KVTransferError("prefill engine restarted since the lease was granted", "stale")
            if pub.fingerprint != self.fingerprint:
                raise KVTransferError(
                    f"peer {pub.engine_id} serves a different model or KV config (fingerprint "
                    f"{pub.fingerprint or 'none'} != ours {self.fingerprint or 'none'}): its KV is not ours to use",
                    "model_mismatch")
            agent = pub.agent_name
        except BaseException:
            if link is not None:
                link.close()
            raise
        addr = (remote.host, remote.port)
        old = self._peers.get(addr)
        if old is not None and old.link.alive() and old.incarnation == pub.incarnation and old.agent == agent:
            link.close()  # another load connected first: keep one link per peer
            return old
        if old is not None:
            self._drop_link(addr, "peer reconnected")
        peer = _Peer(agent, pub.incarnation, link, pub, layout, added=self.transport.peer_incarnation(agent)
                     == pub.incarnation)
        self._peers[addr] = peer
        return peer

    def _agent(self, peer: _Peer) -> str:
        """The peer's NIXL agent name, adding its metadata first if not done yet (KVTransferError if refused)."""
        if not peer.added:
            self.transport.add_peer(peer.publication, peer.layout)
            peer.added = True
        return peer.agent

    def _begin(self, load: _Load, peer: _Peer, out: HandoffPoll) -> None:
        """Present our claim and ask the peer to pin the lease; the READ waits for its "held"."""
        load.peer = peer.agent
        load.state = LoadPhase.VERIFYING
        if load.push:
            self._register(load, peer, out)
            return
        failure = self._ask(load, pin_s=max(0.0, load.deadline - self._clock()) + PIN_MARGIN_S)
        if failure is not None:
            self._fail(load, out, failure)

    def _register(self, load: _Load, peer: _Peer, out: HandoffPoll) -> None:
        """Push: register our reservation on the producer's side channel; it may WRITE until our deadline."""
        try:
            peer.link.register_push(load.remote.request_id, load.epoch, self.transport.agent_name,
                                    max(0.001, load.deadline - self._clock()), load.local_ids, load.remote.token_hash,
                                    load.first, load.num_tokens, self._publication)
        except SideChannelError as e:
            self._drop_link((load.remote.host, load.remote.port), str(e))
            self._fail(load, out, LoadFailure(f"could not register the reservation: {e}", "side_channel"))
            return
        peer.waiting[load.lease] = load
        load.answers_due += 1

    def _withdraw(self, load: _Load) -> None:
        """Push, request aborted: ask the producer to drop the reservation; its blocks are freed on "gone",
        a pushed/pushfail notification, or our deadline (after which the producer posts nothing)."""
        load.cancel_sent = True
        peer = self._peers.get((load.remote.host, load.remote.port))
        if peer is None or peer.agent != load.peer:
            return
        try:
            peer.link.cancel_push(load.remote.request_id, load.epoch, self.transport.agent_name)
            peer.waiting[load.lease] = load
            load.answers_due += 1
        except SideChannelError as e:
            self._drop_link((load.remote.host, load.remote.port), str(e))

    def _post_read(self, load: _Load, out: HandoffPoll) -> None:
        """The producer vouched for the claim and pinned the lease: READ the part we do not have cached,
        never past the pin (a READ running past it could see recycled blocks)."""
        rem = load.remote
        load.state = LoadPhase.READING
        remote_ids = list(rem.block_ids[load.first:load.first + len(load.local_ids)])
        try:
            peer = self._peers.get((rem.host, rem.port))
            if peer is None or peer.agent != load.peer:
                raise KVTransferError("side channel link lost before the READ", "side_channel")
            self._agent(peer)
            load.read_id = self.transport.start_read(
                load.peer, load.local_ids, remote_ids, format_notification("read", rem.request_id, rem.epoch),
                max(0.001, min(load.deadline, load.pinned_until) - self._clock()))
        except KVTransferError as e:
            load.read_done = True
            self._send_abort(load)  # pinned to us: let prefill free it now
            self._fail(load, out, LoadFailure(str(e), e.reason))
            if e.reason == "disconnect":
                self._forget_peer(load.peer)

    def _ask(self, load: _Load, pin_s: float) -> LoadFailure | None:
        """Ask the peer to pin the lease to us; the load's failure if the question could not be sent."""
        addr = (load.remote.host, load.remote.port)
        peer = self._peers.get(addr)
        if peer is None:
            load.failure = load.failure or LoadFailure("could not confirm the lease: side channel link lost",
                                                       "side_channel")
            return load.failure
        try:
            peer.link.ask(load.remote.request_id, load.remote.epoch, self.transport.agent_name, pin_s,
                          load.remote.block_ids, load.remote.token_hash)
        except SideChannelError as e:
            load.failure = load.failure or LoadFailure(f"could not confirm the lease: {e}", "side_channel")
            self._drop_link(addr, str(e))
            return load.failure
        load.asked_at = self._clock()
        peer.waiting[load.lease] = load
        return None

    def _send_abort(self, load: _Load) -> None:
        """Tell prefill we will never read, so it frees the blocks now rather than at lease expiry."""
        try:
            peer = self._peers.get((load.remote.host, load.remote.port))
            if peer is not None and peer.agent == load.peer:
                self._agent(peer)
            self.transport.send_notif(load.peer,
                                      format_notification("abort", load.remote.request_id, load.remote.epoch))
            self._flush_until = self._clock() + NOTIF_FLUSH_S
        except KVTransferError as e:
            log.info("abort notification to %s failed (lease will expire): %s", load.peer, e)

    def _fail(self, load: _Load, out: HandoffPoll, failure: LoadFailure) -> None:
        self._loads.pop(load.request_id, None)
        self._push_loads.pop(load.lease, None)
        peer = self._peers.get((load.remote.host, load.remote.port))
        if peer is not None and peer.waiting.get(load.lease) is load:
            del peer.waiting[load.lease]
        self.stats.record_failure(failure.reason)
        log.warning("KV load for %s from %s failed (%s): %s", load.request_id, load.remote.engine_id,
                    failure.reason, failure.error)
        out.loads.append(LoadOutcome(load.request_id, False, failure.error, failure.reason,
                                     seconds=self._clock() - load.started))

    def _drop_link(self, addr: tuple[str, int], why: str) -> None:
        """Forget a peer's side-channel link (the NIXL agent stays; the next load reconnects). Loads still
        waiting for an answer on it fail once their READ has ended."""
        peer = self._peers.pop(addr, None)
        if peer is None:
            return
        peer.link.close()
        for load in peer.waiting.values():
            load.failure = load.failure or LoadFailure(f"could not confirm the lease: {why}", "side_channel")
        peer.waiting.clear()
        for load in self._loads.values():
            if load.push and load.peer == peer.agent:
                # the producer may still be WRITING (a link closed by its limits): free at our deadline
                load.failure = load.failure or LoadFailure(f"side channel to the prefill engine lost: {why}",
                                                           "side_channel")

    def _forget_peer(self, agent: str) -> None:
        self.transport.remove_peer(agent)
        for addr, peer in list(self._peers.items()):
            if peer.agent == agent:
                self._drop_link(addr, f"peer {agent} disconnected")

    def _remember_consumed(self, remote: RemoteKV) -> None:
        self._consumed[(remote.request_id, remote.epoch)] = None
        while len(self._consumed) > CONSUMED_MEMORY:
            del self._consumed[next(iter(self._consumed))]
