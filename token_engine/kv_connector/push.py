"""Push mode, producer half: prefill WRITEs a request's KV into blocks a decode engine reserved for it.

Decode registers a reservation on prefill's side channel (op `push_register`, over the link it keeps to
prefill, authenticated when a secret is set): the prefill request id, decode's reservation epoch, its block
ids for prompt blocks [first, ...), the token count and token hash those blocks are for, and decode's NIXL
publication. This module keeps those reservations (`PushTarget`) and, as the prefill computes, WRITEs every
finished prompt block into them (after each engine step: one WRITE per prefill chunk, overlapping the next
chunk's compute). The last WRITE is posted once the request finished and every earlier WRITE is DONE, and
carries the `pushed:<request id>:<epoch>` notification, which NIXL delivers after the bytes.

Guarantees, the same as pull's (docs/security.md "KV handoff"):
- a WRITE is posted only after `claim_mismatch` accepted the reservation against what prefill computed:
  decode reserved for exactly the tokens whose KV is written (token hash); before the last WRITE the
  finished request's lease is pinned to the decode agent with the same check, so it can neither expire nor
  be released while its blocks are being written from;
- nothing is posted after the reservation's window (decode's own deadline minus a margin): decode frees
  blocks it reserved only after that, or after a `pushed` / `pushfail` notification, or its withdrawal was
  answered "gone";
- a reservation that cannot be served (aborted prefill, refused claim, failed WRITE, window over) ends with a
  `pushfail` notification once no WRITE of it is in flight, and its lease is released.
Everything is bounded: MAX_TARGETS reservations, one per prefill request id.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from token_engine.kv_connector.descriptors import PoolLayout
from token_engine.kv_connector.leases import KVLease, LeaseTable, claim_mismatch, format_notification
from token_engine.kv_connector.nixl_transport import KVTransferError, NixlTransport, ReadResult
from token_engine.kv_connector.side_channel import (
    AgentPublication,
    SideChannelError,
    SideChannelRequest,
    validate_publication,
)

log = logging.getLogger("token_engine.kv_transfer")
MAX_TARGETS = 4096
WINDOW_MARGIN_S = 2.0  # prefill stops posting this long before decode's deadline (clock and network slack)
MAX_WINDOW_S = 600.0


@dataclass
class PushTarget:
    request_id: str  # the prefill request (seq id) whose KV decode wants
    epoch: int  # decode's reservation epoch
    agent: str  # decode's NIXL agent
    block_ids: list[int]  # decode's blocks for prompt blocks [first, first + len)
    first: int
    num_tokens: int
    token_hash: str
    window_end: float
    publication: AgentPublication
    layout: PoolLayout
    verified: bool = False
    written: int = 0  # how many of block_ids have a WRITE posted
    inflight: set[int] = field(default_factory=set)
    final_posted: bool = False
    cancelled: bool = False
    failure: str = ""
    bytes: int = 0
    descriptors: int = 0
    writes: int = 0
    started: float = 0.0
    final_at: float = 0.0  # when the last WRITE was posted: push's handoff time runs from here to DONE


@dataclass
class PushSource:
    """What the prefill engine computed so far for one push-mode request (updated every step)."""

    block_ids: list[int]
    prompt: list[int]
    computed: int
    lease: tuple[str, int] | None = None  # set when the request finished and its blocks are held
    aborted: bool = False


@dataclass
class PushDone:
    request_id: str
    ok: bool
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    reason: str = ""
    writes: int = 0


class PushProducer:
    def __init__(self, transport: NixlTransport, leases: LeaseTable, block_size: int, fingerprint: str,
                 token_hash, clock):
        self.transport = transport
        self.leases = leases
        self.block_size = block_size
        self.fingerprint = fingerprint
        self._token_hash = token_hash
        self._clock = clock
        self._targets: dict[str, PushTarget] = {}  # by prefill request id
        self._sources: dict[str, PushSource] = {}
        self._lock = threading.Lock()  # the side-channel thread registers while the engine's poller writes

    # -- side channel thread ----------------------------------------------------------------------------

    def on_request(self, req: SideChannelRequest) -> tuple[str, float]:
        if req.op == "push_cancel":
            return self._cancel(req)
        try:
            target = self._validate(req)
        except (ValueError, SideChannelError) as e:
            log.warning("push reservation for %s refused: %s", req.request_id, e)
            return "refused", 0.0
        with self._lock:
            if req.request_id in self._targets or len(self._targets) >= MAX_TARGETS:
                return "refused", 0.0
            self._targets[req.request_id] = target
        return "held", target.window_end - self._clock()

    def _validate(self, req: SideChannelRequest) -> PushTarget:
        if req.publication is None or not req.request_id or not 0 < req.pin_s <= MAX_WINDOW_S:
            raise ValueError("reservation without publication, request id or window")
        layout = validate_publication(req.publication)
        if req.publication.fingerprint != self.fingerprint:
            raise ValueError("decode serves another model or KV config")
        if not self.transport.layout.geometry.compatible_with(layout.geometry):
            raise ValueError("KV geometry differs")
        blocks = req.block_ids or []
        if req.first < 0 or req.num_tokens <= 0 or len(blocks) != -(-req.num_tokens // self.block_size) - req.first \
                or not blocks or req.publication.agent_name != req.reader:
            raise ValueError("reservation blocks do not cover its tokens")
        now = self._clock()
        return PushTarget(req.request_id, req.epoch, req.reader, list(blocks), req.first, req.num_tokens,
                          req.token_hash, now + req.pin_s - WINDOW_MARGIN_S, req.publication, layout, started=now)

    def _cancel(self, req: SideChannelRequest) -> tuple[str, float]:
        with self._lock:
            target = self._targets.get(req.request_id)
            if target is None or target.epoch != req.epoch or target.agent != req.reader:
                return "gone", 0.0
            target.cancelled = True
            if target.inflight:
                return "held", 0.0  # a pushfail notification follows once the WRITE ends
            del self._targets[req.request_id]
            return "gone", 0.0

    # -- engine side ------------------------------------------------------------------------------------

    def update_source(self, request_id: str, block_ids: list[int], prompt: list[int], computed: int,
                      lease: tuple[str, int] | None = None, aborted: bool = False) -> None:
        source = PushSource(list(block_ids), prompt, computed, lease, aborted)
        with self._lock:
            # Decode names the id its caller gave; the engine server runs it under that id + "-" + 8 hex digits.
            for key in _source_keys(request_id):
                self._sources[key] = source

    def drop_source(self, request_id: str) -> None:
        with self._lock:
            for key in _source_keys(request_id):
                self._sources.pop(key, None)

    def busy(self) -> bool:
        return bool(self._targets)

    def progress(self, writes: dict[int, ReadResult], freed: list[KVLease]) -> list[PushDone]:
        """Called under the handoff's lock with the transfers NIXL finished: advance every reservation."""
        done: list[PushDone] = []
        now = self._clock()
        with self._lock:
            for rid in [r for r, src in self._sources.items() if src.aborted and r not in self._targets]:
                del self._sources[rid]  # nothing registered for an aborted prefill: nothing to tell
            for target in list(self._targets.values()):
                for wid in [w for w in target.inflight if w in writes]:
                    target.inflight.discard(wid)
                    r = writes[wid]
                    if r.ok:
                        target.bytes += r.bytes
                        target.descriptors += r.descriptors
                    else:
                        target.failure = target.failure or f"WRITE failed: {r.error}"
                source = self._sources.get(target.request_id)
                if not target.failure:
                    if target.cancelled:
                        target.failure = "cancelled by decode"
                    elif source is not None and source.aborted:
                        target.failure = "the prefill request was aborted"
                    elif now > target.window_end and not (target.final_posted and target.inflight):
                        target.failure = "the reservation's window passed"
                if target.failure:
                    if not target.inflight:
                        done.append(self._end(target, source, freed, ok=False))
                    continue
                if source is None:
                    continue
                try:
                    self._advance(target, source, now)
                except KVTransferError as e:
                    target.failure = f"{e.reason}: {e}"
                    if not target.inflight:
                        done.append(self._end(target, source, freed, ok=False))
                    continue
                if target.final_posted and not target.inflight:
                    done.append(self._end(target, source, freed, ok=True))
        return done

    def _advance(self, target: PushTarget, source: PushSource, now: float) -> None:
        bs = self.block_size
        if not target.verified:
            if target.num_tokens > len(source.prompt):
                raise KVTransferError("reservation for more tokens than the prompt has", "refused")
            ours = KVLease(target.request_id, 0, target.block_ids, 0.0,
                           token_hash=self._token_hash(source.prompt[:target.num_tokens]))
            why = claim_mismatch(ours, target.block_ids, target.token_hash)
            if why is not None:
                raise KVTransferError(why, "refused")
            self.transport.add_peer(target.publication, target.layout)
            target.verified = True
        total = target.first + len(target.block_ids)
        held = source.lease
        if held is not None and not target.final_posted and not target.inflight:
            # pin the lease to decode with the same claim check: it cannot expire or be released under the WRITE
            lease = next((x for x in self.leases.find(held[0]) if x.epoch == held[1]), None)
            if lease is None:
                raise KVTransferError("the prefill lease ended before the push", "stale")
            status, _ = self.leases.pin(held[0], held[1], target.agent,
                                        max(0.001, target.window_end - now), lease.block_ids, target.token_hash)
            if status != "held":
                raise KVTransferError(f"lease {status} for this reservation", "refused")
            self._post(target, source, total, format_notification("pushed", target.request_id, target.epoch), now)
            target.final_posted, target.final_at = True, now
        elif held is None:
            ready = min(source.computed // bs, total - 1)  # the last block always goes with the notification
            if ready > target.first + target.written:
                self._post(target, source, ready, b"", now)

    def _post(self, target: PushTarget, source: PushSource, upto: int, notif: bytes, now: float) -> None:
        start = target.first + target.written
        if upto <= start and not notif:
            return
        local = source.block_ids[start:upto]
        remote = target.block_ids[start - target.first:upto - target.first]
        if len(local) != len(remote):
            raise KVTransferError("prefill holds fewer blocks than the reservation", "refused")
        if not local:  # nothing left to write (cannot happen: the last block is kept for the notification)
            self.transport.send_notif(target.agent, notif)
            return
        if self.transport.layout.mem_type == "VRAM":
            import torch

            torch.cuda.current_stream().synchronize()  # the step's KV writes have landed before the WRITE reads
        wid = self.transport.start_write(target.agent, local, remote, notif, max(0.001, target.window_end - now))
        target.inflight.add(wid)
        target.writes += 1
        target.written = upto - target.first

    def _end(self, target: PushTarget, source: PushSource | None, freed: list[KVLease], ok: bool) -> PushDone:
        self._targets.pop(target.request_id, None)
        if not ok:
            log.warning("push of %s to %s failed: %s", target.request_id, target.agent, target.failure)
            try:  # tell decode now, rather than let it wait for its deadline
                self.transport.add_peer(target.publication, target.layout)
                self.transport.send_notif(target.agent, format_notification("pushfail", target.request_id,
                                                                            target.epoch))
            except KVTransferError as e:
                log.info("pushfail notification to %s failed: %s", target.agent, e)
        if source is not None and source.lease is not None:
            # pushed (or never will be): the held blocks go back; pinned to decode, so end it as that reader
            lease = self.leases.on_read(*source.lease, target.agent) if ok else \
                self.leases.release(*source.lease, reader=target.agent)
            if lease is not None:
                freed.append(lease)
            self._sources.pop(target.request_id, None)
        return PushDone(target.request_id, ok, target.bytes, target.descriptors,
                        self._clock() - (target.final_at or target.started),
                        "" if ok else target.failure, target.writes)

    def close(self) -> None:
        with self._lock:
            self._targets.clear()
            self._sources.clear()


def _source_keys(request_id: str) -> tuple[str, ...]:
    """The engine id, and the caller's id when the engine id carries the server's 8-hex-digit suffix."""
    head, sep, tail = request_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return request_id, head
    return (request_id,)
