"""The KV connector seam (vLLM v1 style): where P/D plugs into the engine without rewriting it.

Scheduler side: for a new request the scheduler asks how many prompt tokens a peer already holds
(`get_num_new_matched_tokens`), allocates blocks for them, tells the connector where they go
(`update_state_after_alloc`) and, for an asynchronous load, parks the request in WAITING_FOR_REMOTE_KVS
until `poll()` reports the load finished or failed. When a request finishes the connector is told
(`request_finished`) and may keep the blocks (delay_free) until `poll()` reports the peer has read them.

Worker side: `bind_kv_pool` hands over the engine's one KV pool tensor (block-major: one block across all
layers is one contiguous region) so the connector can register it for transfers.

The engine loop calls `poll()` every step, and while idle at least every ~1 ms whenever
`has_inflight_transfers()` is true. Requests are identified to the connector by `Sequence.seq_id` (str).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from token_engine.core.sequence import Sequence


@dataclass
class ConnectorEvents:
    """What `poll()` observed since the last call, keyed by seq_id."""

    finished_recving: set[str] = field(default_factory=set)  # remote KV landed; the request may run
    failed_recving: set[str] = field(default_factory=set)  # remote KV load failed (policy decides)
    finished_sending: set[str] = field(default_factory=set)  # peer read our blocks; free them now
    failure_reasons: dict[str, str] = field(default_factory=dict)  # seq_id -> why its load failed (for the caller)
    refused_recving: set[str] = field(default_factory=set)  # of failed_recving: the caller's params were refused


# Prefix of a request's error when its remote KV could not be loaded (policy "fail"); the server answers 502.
KV_LOAD_FAILED = "KV handoff failed"
# Prefix when the caller's kv_transfer_params were refused (malformed, not the lease's blocks or tokens, a peer
# that is not allowed): the caller's fault, 400.
KV_PARAMS_REFUSED = "KV handoff refused"
# What our prefill's kv_transfer_params carry and vLLM's NixlConnector's do not (a lease to prove, the tokens held).
OURS_ONLY_KV_KEYS = ("remote_lease_epoch", "remote_token_hash")


def foreign_prefill_params(params: Any) -> str | None:
    """Why decode-side kv_transfer_params come from another implementation's prefill (vLLM's NixlConnector), or
    None. Such params name blocks of a peer whose side channel and layout ours cannot read: refused at once with
    this message (a 400), instead of a pull that could only fail later."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    if params.get("remote_block_ids") is None:  # push params: they name a producer, not a lease's blocks
        return None
    if not params.get("remote_engine_id") or any(key in params for key in OURS_ONLY_KV_KEYS):
        return None
    return (f"{KV_PARAMS_REFUSED}: kv_transfer_params come from another implementation's prefill (vLLM's "
            f"NixlConnector: remote_engine_id {str(params.get('remote_engine_id'))[:80]!r} without "
            f"{' or '.join(OURS_ONLY_KV_KEYS)}); a splitserve decode engine pulls KV only from splitserve "
            "prefill engines. Keep each prefill/decode pair within one implementation (docs/compatibility.md, "
            "mixed implementations).")


@runtime_checkable
class KVConnector(Protocol):
    # "fail": error the request; "recompute": compute the prompt locally instead (vLLM's names).
    load_failure_policy: str

    def bind_kv_pool(self, kv_pool: torch.Tensor, block_size: int) -> None: ...

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond num_computed_tokens a peer can provide, whether loading them is asynchronous)."""
        ...

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None: ...

    def admit(self, seqs: list[Sequence], caller: str | None) -> str | None:
        """Before a request is queued: None to accept it, else why it is refused.
        `caller` names who asked (the client address), None for in-process callers."""
        ...

    def may_start(self, seq: Sequence) -> bool:
        """Before the scheduler first gives a queued sequence KV blocks: False keeps it waiting (its caller
        holds its share of leased KV); the scheduler asks again on a later step and starts others meanwhile."""
        ...

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(delay_free: keep the blocks until finished_sending, kv_transfer_params for the response)."""
        ...

    def abort_held(self, request_id: str) -> list[str]:
        """The request was aborted after it finished (a failed decode hop): release the KV it holds for a
        peer that has not started reading it. Returns the seq_ids whose blocks the caller frees now."""
        ...

    def poll(self) -> ConnectorEvents: ...

    def release_turn_hold(self) -> str | None:
        """Give up the oldest KV held only for a possible later reuse; its request id, or None."""
        ...

    def has_inflight_transfers(self) -> bool: ...

    def stats(self) -> dict[str, float]:
        """Totals (transfer bytes, seconds...) for logs and tests; names are the connector's."""
        ...

    def render_metrics(self) -> bytes:
        """Prometheus text appended to the engine's /metrics (transfer time and bytes first)."""
        ...

    def shutdown(self) -> None: ...


class NoOpKVConnector:
    """The collocated default: nothing remote, nothing held."""

    load_failure_policy = "fail"

    def bind_kv_pool(self, kv_pool, block_size):
        pass

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        pass

    def admit(self, seqs, caller):
        return None

    def may_start(self, seq):
        return True

    def request_finished(self, seq, block_ids):
        return False, None

    def abort_held(self, request_id):
        return []

    def poll(self):
        return ConnectorEvents()

    def release_turn_hold(self):
        return None

    def has_inflight_transfers(self):
        return False

    def stats(self):
        return {}

    def render_metrics(self):
        return b""

    def shutdown(self):
        pass


# kv_connector name (as in --kv-transfer-config) -> "module:Class"; imported lazily so NIXL stays optional.
KV_CONNECTORS: dict[str, str] = {
    "NixlConnector": "token_engine.kv_connector.nixl:NixlConnector",
    "NixlPushConnector": "token_engine.kv_connector.nixl_push:NixlPushConnector",
}


def create_kv_connector(kv_transfer_config: dict | None, engine_config: Any = None) -> KVConnector:
    """Build the connector named by `kv_transfer_config["kv_connector"]`; None means collocated (no-op).

    Connector classes are constructed as `cls(kv_transfer_config, engine_config)` where engine_config is
    token_engine.core.engine.EngineConfig (block size, served model name, device...).
    """
    if not kv_transfer_config:
        return NoOpKVConnector()
    name = kv_transfer_config.get("kv_connector")
    if name in (None, "", "NoOpKVConnector"):
        return NoOpKVConnector()
    target = KV_CONNECTORS.get(name)
    if target is None:
        raise ValueError(f"unknown kv_connector {name!r}; known: {sorted(KV_CONNECTORS)}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(kv_transfer_config, engine_config)
