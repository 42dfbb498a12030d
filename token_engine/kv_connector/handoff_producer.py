"""The prefill half of a KV handoff: holds blocks under leases, serves the side channel (lease claims and pins,
push registrations), answers decode's notifications (read, heartbeat, abort), and WRITEs pushed KV. Not
thread-safe by itself: KVHandoff calls it under its one lock, except the side channel's push callback, which
PushProducer serialises itself."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from token_engine.kv_connector.handoff_types import HandoffPoll
from token_engine.kv_connector.leases import KVLease, LeaseNotification, LeaseTable
from token_engine.kv_connector.metrics import TransferLog
from token_engine.kv_connector.nixl_transport import NixlTransport, ReadResult
from token_engine.kv_connector.push import PushProducer
from token_engine.kv_connector.side_channel import AgentPublication, SideChannelRequest, SideChannelServer

log = logging.getLogger("token_engine.kv_transfer")

# The notifications a reader sends the producer about one of its leases.
ReaderNotification = Literal["read", "HB", "abort"]
READER_NOTIFICATIONS: tuple[ReaderNotification, ...] = ("read", "HB", "abort")


class HandoffProducer:
    def __init__(self, transport: NixlTransport, leases: LeaseTable, publication: AgentPublication,
                 stats: TransferLog, wake: threading.Event, block_size: int, fingerprint: str,
                 token_hash: Callable[[list[int]], str] | None, clock: Callable[[], float],
                 side_channel_host: str, side_channel_port: int, secret: bytes | None):
        self.leases = leases
        self.stats = stats
        self._wake = wake
        self.push = PushProducer(transport, leases, block_size, fingerprint, token_hash, clock)
        self.side_channel = SideChannelServer(publication, leases.status, host=side_channel_host,
                                              port=side_channel_port, lease_pin=leases.pin, secret=secret,
                                              push=self._on_push_request)

    def hold(self, request_id: str, block_ids: list[int], duration_s: float | None = None, token_hash: str = "",
             caller: str | None = None) -> KVLease:
        lease = self.leases.grant(request_id, block_ids, duration_s, token_hash, caller)
        self._wake.set()  # the peer's first READ needs our progress (no NIXL progress thread)
        return lease

    def release_hold(self, request_id: str, epoch: int) -> KVLease | None:
        return self.leases.release(request_id, epoch)

    def _on_push_request(self, req: SideChannelRequest) -> tuple[str, float]:
        answer = self.push.on_request(req)
        self._wake.set()
        return answer

    def push_source(self, request_id: str, block_ids: list[int], prompt: list[int], computed: int,
                    lease: tuple[str, int] | None = None, aborted: bool = False) -> None:
        """Push mode: what the request has computed so far; `lease` once it finished and is held."""
        self.push.update_source(request_id, block_ids, prompt, computed, lease, aborted)
        self._wake.set()

    def busy(self) -> bool:
        return len(self.leases) > 0 or self.push.busy()

    def on_notification(self, agent: str, n: LeaseNotification, out: HandoffPoll) -> None:
        """A reader's read / HB / abort for one of our leases."""
        if n.kind == "read":
            lease = self.leases.on_read(n.request_id, n.epoch, agent)
            if lease is not None:
                out.freed.append(lease)
        elif n.kind == "HB":
            self.leases.on_heartbeat(n.request_id, n.epoch)
        elif n.kind == "abort":
            lease = self.leases.release(n.request_id, n.epoch, reader=agent)
            if lease is not None:
                out.freed.append(lease)

    def progress_pushes(self, writes: dict[int, ReadResult], out: HandoffPoll) -> None:
        for done in self.push.progress(writes, out.freed):
            if done.ok:
                self.stats.record_push(done.bytes, done.seconds, "prefill", done.writes)
            else:
                self.stats.record_failure("push_" + done.reason.split(":")[0].replace(" ", "_")[:32])
            out.pushes.append(done)

    def expire(self, out: HandoffPoll) -> None:
        for lease in self.leases.expire():
            self.stats.metrics.leases_expired.inc()
            log.info("KV lease expired unread: request %s epoch %d (%d blocks freed)",
                     lease.request_id, lease.epoch, len(lease.block_ids))
            out.freed.append(lease)
        self.stats.metrics.held_blocks.set(self.leases.held_blocks())

    def close_side_channel(self) -> None:
        self.side_channel.close()

    def close(self) -> None:
        self.push.close()
