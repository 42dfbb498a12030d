"""What both halves of a KV handoff share: the claim decode holds about remote blocks, and what one poll()
hands back to the engine (leases prefill may free, loads decode finished, pushes prefill completed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from token_engine.kv_connector.leases import KVLease
from token_engine.kv_connector.push import PushDone


@dataclass(frozen=True)
class RemoteKV:
    """What decode knows about blocks held by a prefill engine (from kv_transfer_params, untrusted)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    epoch: int
    block_ids: tuple[int, ...]  # every block id of the lease, as claimed
    token_hash: str = ""  # which tokens the blocks hold KV for, as claimed (the producer refuses "")

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
    pushes: list[PushDone] = field(default_factory=list)  # prefill: pushes that completed or failed
