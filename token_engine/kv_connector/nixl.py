"""NixlConnector: prefill/decode disaggregation behind the engine's KV connector seam (base.py).

Prefill (request with kv_transfer_params.do_remote_decode): the engine computes the prompt and samples one
token; `request_finished` then holds the prompt's blocks under a lease and returns vLLM's keys
(do_remote_prefill, remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port, tp_size,
remote_num_tokens) plus `remote_lease_epoch`, which decode needs to prove its READ saw these blocks and not
recycled ones. A caller that forwards the whole object (vLLM's toy proxy does) carries it unchanged.

Decode (request with do_remote_prefill): `get_num_new_matched_tokens` says the peer holds the prompt's KV,
the scheduler allocates blocks and parks the request, `update_state_after_alloc` starts the READ, and
`poll()` (every step, ~1 ms while anything is in flight) reports the load as finished or failed; the
scheduler then applies kv_load_failure_policy. kv_transfer_params are untrusted: anything malformed is a
failed load (policy "fail": a clear error; "recompute": computed locally).

Bidirectional multi-turn (bidirectional_kv_xfer on both engines): at the end of a turn decode holds its
blocks (prompt + output, minus the last token, which has no KV yet) for decoder_kv_blocks_ttl and returns
their params; the caller sends them to prefill next turn with do_remote_decode. Prefill pulls them and
computes only the new tokens, but only if the new prompt extends the held tokens exactly: every params object
we return carries `remote_token_hash` (sha256 of the held token ids), and a prompt whose prefix does not
hash the same (a template that drops reasoning from history, say) is recomputed instead. vLLM has no such
guard and silently decodes from KV of other tokens (vllm#43094). Params without the hash are not reused.

Trust (docs/security.md, "KV handoff"): kv_transfer_params come from the caller. A load must present the
lease's exact block ids and its token hash (mandatory, and checked here against this prompt); the producer
checks both against what it recorded for the lease before decode READs anything (handoff_consumer.py), so
loaded KV (and what it then publishes in the prefix cache) is KV the producer vouched for, for exactly these
tokens.
Refusals are the caller's fault (KV_PARAMS_REFUSED, 400). Decode contacts only allowed peers (peers.py); the
side channel authenticates with a shared secret when one is set. A caller may hold at most
kv_lease_budget_fraction of prefill's blocks under leases (and in-flight prefills for remote decode) at once;
its further prefills wait in the queue (may_start); `abort_held` releases a lease whose decode hop failed.

Both sides publish a fingerprint of their weights and KV config (fingerprint.py); a load from a peer whose
fingerprint differs fails (reason "model_mismatch") and the failure policy applies. While a decode request
waits for its remote KV before the load starts (no free blocks yet), `poll()` sends the peer heartbeats
(`HB`) every lease/3 seconds so its lease is extended (as vLLM does) instead of expiring under a long queue.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypeVar

from splitserve_common.auth import is_loopback
from token_engine.kv_connector.base import ConnectorEvents
from token_engine.kv_connector.config import NixlConnectorConfig, parse_nixl_config
from token_engine.kv_connector.fingerprint import model_fingerprint
from token_engine.kv_connector.handoff import KVHandoff
from token_engine.kv_connector.handoff_types import RemoteKV
from token_engine.kv_connector.leases import KVLease
from token_engine.kv_connector.peers import AllowedPeers

if TYPE_CHECKING:
    import torch

    from token_engine.core.sequence import Sequence

T = TypeVar("T")

log = logging.getLogger("token_engine.kv_transfer")
MAX_REMOTE_BLOCKS = 1 << 20
TOKEN_HASH_CHARS = 32
REFUSED_REASONS = frozenset({"refused", "not_allowed", "invalid"})  # the caller's params, not the infrastructure


class BadTransferParams(ValueError):
    pass


def token_hash(token_ids: list[int]) -> str:
    """Names exactly which tokens a set of held blocks holds KV for."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


def _flat_block_ids(value: object) -> list[int]:
    """vLLM sends a flat list (old) or one list per KV-cache group (new); we have one group."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or len(value) > MAX_REMOTE_BLOCKS or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        raise BadTransferParams("remote_block_ids must be a list of non-negative block ids")
    return value


def parse_remote(params: dict[str, Any], prompt_token_ids: list[int], block_size: int) -> tuple[RemoteKV, int]:
    """(RemoteKV, remote_num_tokens) from decode-side kv_transfer_params, validated."""
    def need(key: str, typ: type[T]) -> T:
        v = params.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise BadTransferParams(f"kv_transfer_params.{key} missing or not a {typ.__name__}")
        return v

    blocks = _flat_block_ids(params.get("remote_block_ids"))
    engine_id, host = need("remote_engine_id", str), need("remote_host", str)
    port, request_id, epoch = need("remote_port", int), need("remote_request_id", str), need("remote_lease_epoch", int)
    if not 0 < port < 65536 or not 0 <= epoch < 1 << 63:
        raise BadTransferParams("kv_transfer_params.remote_port or remote_lease_epoch out of range")
    if params.get("tp_size", 1) != 1:
        raise BadTransferParams("only tp_size 1 is supported")
    num_tokens = params.get("remote_num_tokens", len(prompt_token_ids))
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 < num_tokens <= len(prompt_token_ids):
        raise BadTransferParams("remote_num_tokens must be between 1 and the prompt length")
    if len(blocks) != -(-num_tokens // block_size):
        raise BadTransferParams(f"{len(blocks)} remote blocks cannot hold exactly {num_tokens} tokens")
    echoed = params.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_token_ids:
        raise BadTransferParams("kv_transfer_params.prompt_token_ids differ from the request's prompt")
    held_hash = params.get("remote_token_hash")
    if not isinstance(held_hash, str) or len(held_hash) != TOKEN_HASH_CHARS:
        raise BadTransferParams("kv_transfer_params.remote_token_hash missing or malformed: without it the "
                                "peer's KV cannot be tied to this prompt")
    if held_hash != token_hash(prompt_token_ids[:num_tokens]):
        raise BadTransferParams("the peer holds KV for other tokens than this prompt's first remote_num_tokens")
    return RemoteKV(engine_id, host, port, request_id, epoch, tuple(blocks), held_hash), num_tokens


class NixlConnector:
    cache_source = "p2p"  # prompt tokens it loads come from another engine (vLLM's metric source)

    def __init__(self, kv_transfer_config: dict[str, Any], engine_config: object = None):
        self.config: NixlConnectorConfig = parse_nixl_config(kv_transfer_config)
        self.load_failure_policy = self.config.load_failure_policy
        self.block_size = getattr(engine_config, "block_size", 16)
        self._model_dir = getattr(engine_config, "model", None)
        self.handoff: KVHandoff | None = None
        self._advertised_host = self.config.side_channel_host
        self._planned: dict[str, tuple[RemoteKV | None, int, str]] = {}  # seq_id -> (remote, num_computed, error)
        self._failed_now: dict[str, str] = {}  # invalid loads -> why, reported by the next poll()
        self._awaiting: dict[str, tuple[RemoteKV, float]] = {}  # queued decode -> (its remote KV, next heartbeat)
        self.heartbeat_interval_s = self.config.lease_duration_s / 3
        self.heartbeats_sent = 0
        self._lease_epochs: dict[str, int] = {}  # prefill: seq_id -> epoch of its lease
        self._lease_requests: dict[str, str] = {}  # seq_id -> its request's id (abort by request id)
        self._turn_holds: OrderedDict[str, int] = OrderedDict()  # decode: turns held for a next prefill, oldest first
        # Lease budgets (engine thread only): blocks each caller holds under leases or has reserved for a
        # prefill in flight; seq_id -> (caller, reserved blocks) until the prefill finishes.
        self._caller_blocks: dict[str, int] = {}
        self._reserved: dict[str, tuple[str, int]] = {}
        self._callers: dict[str, str] = {}  # queued prefill seq_id -> its caller, until may_start reserves
        self.lease_budget_blocks = 0  # set once the pool is known

    # -- worker side ------------------------------------------------------------------------------------

    def bind_kv_pool(self, kv_pool: torch.Tensor, block_size: int) -> None:
        # The pool already lives on its device, so on GPU the CUDA context exists and the pool is registered
        # before any remote agent is added (see nixl_transport.py).
        self.block_size = block_size
        host = self.config.side_channel_host
        bind_host = "127.0.0.1" if host == "localhost" else host
        self.fingerprint = model_fingerprint(self._model_dir, str(kv_pool.dtype).removeprefix("torch."), block_size)
        self.lease_budget_blocks = max(1, int(self.config.lease_budget_fraction * kv_pool.shape[0]))
        self.handoff = KVHandoff(
            self.config.engine_id, kv_pool, lease_duration_s=self.config.lease_duration_s,
            load_timeout_s=self.config.load_timeout_s, side_channel_host=bind_host,
            side_channel_port=self.config.side_channel_port, log_interval_s=self.config.log_interval_s,
            fingerprint=self.fingerprint, secret=self.config.side_channel_secret,
            allowed_peers=AllowedPeers(self.config.allowed_peers), block_size=block_size, token_hash=token_hash)
        if host in ("0.0.0.0", ""):
            self._advertised_host = socket.gethostbyname(socket.gethostname())
        warn_if_exposed(bind_host, self.handoff.side_channel.port, self.config.side_channel_secret)
        log.info("%s %s (%s, policy %s): side channel %s:%d (%s), lease %.0f s, peers %s",
                 type(self).__name__, self.config.engine_id, self.config.kv_role, self.load_failure_policy,
                 self._advertised_host,
                 self.handoff.side_channel.port, "authenticated" if self.config.side_channel_secret else "open",
                 self.config.lease_duration_s, ",".join(self.config.allowed_peers))

    def _bound(self) -> KVHandoff:
        """The handoff, which exists once bind_kv_pool ran (the engine binds the pool before any request)."""
        if self.handoff is None:
            raise RuntimeError("NixlConnector used before bind_kv_pool")
        return self.handoff

    # -- decode: loading remote KV ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        params = seq.kv_transfer_params
        if not params:
            return 0, False
        if params.get("do_remote_prefill"):
            return self._plan_load(seq, params, num_computed_tokens, refuse_is_failure=True)
        if params.get("do_remote_decode") and params.get("remote_block_ids") and self.config.bidirectional:
            return self._plan_turn_reuse(seq, params, num_computed_tokens)
        return 0, False

    def _plan_load(self, seq: Sequence, params: dict[str, Any], num_computed_tokens: int,
                   refuse_is_failure: bool) -> tuple[int, bool]:
        try:
            remote, num_tokens = parse_remote(params, seq.prompt_token_ids, self.block_size)
        except BadTransferParams as e:
            if not refuse_is_failure or self.load_failure_policy == "recompute":
                log.warning("request %s: %s; computing the prompt locally", seq.seq_id, e)
                return 0, False
            # Under "fail" a bad handoff must reach the caller as an error: park it and fail it in poll().
            self._planned[seq.seq_id] = (None, num_computed_tokens, str(e))
            return max(1, seq.prompt_len - num_computed_tokens), True
        external = num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False  # the local prefix cache already has all of it
        self._planned[seq.seq_id] = (remote, num_computed_tokens, "")
        if seq.seq_id not in self._awaiting:  # heartbeat from the next poll() on, until the load starts
            self._awaiting[seq.seq_id] = (remote, time.monotonic())
        return external, True

    def _plan_turn_reuse(self, seq: Sequence, params: dict[str, Any], num_computed_tokens: int) -> tuple[int, bool]:
        """Prefill of a later turn: pull what decode holds for the conversation, only on an exact extension."""
        held = params.get("remote_num_tokens")
        if not isinstance(params.get("remote_token_hash"), str) or not isinstance(held, int) \
                or not 0 < held < seq.prompt_len:
            log.info("request %s: held conversation KV cannot be checked against the prompt; recomputing",
                     seq.seq_id)
            return 0, False
        # parse_remote checks the hash: a prompt that does not extend the held tokens exactly is refused.
        return self._plan_load(seq, params, num_computed_tokens, refuse_is_failure=False)

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        remote, num_computed, error = self._planned.pop(seq.seq_id, (None, 0, "no remote KV planned"))
        self._awaiting.pop(seq.seq_id, None)
        if remote is None:
            log.warning("KV load for %s refused: %s", seq.seq_id, error)
            self._failed_now[seq.seq_id] = f"invalid kv_transfer_params: {error}"
            return
        first = num_computed // self.block_size  # cached blocks are full blocks
        count = -(-num_external_tokens // self.block_size)
        local_ids = block_ids[first:first + count]
        try:  # the claim is the whole lease; the READ skips what the local prefix cache already holds
            self._bound().start_load(seq.seq_id, remote, local_ids, first)
        except Exception as e:  # noqa: BLE001 - any refusal is a failed load, never an engine crash
            log.warning("KV load for %s refused: %s", seq.seq_id, e)
            self._failed_now[seq.seq_id] = f"load refused: {e}"

    # -- prefill: holding KV for a remote decode --------------------------------------------------------

    def admit(self, seqs: list[Sequence], caller: str | None) -> str | None:
        """Remember who asked for prefills whose KV will be held for a remote decode: the lease budget
        charges that caller when the scheduler starts them (may_start)."""
        if caller is None or self.handoff is None:
            return None
        for seq in seqs:
            params = seq.kv_transfer_params
            if params and params.get("do_remote_decode") and not params.get("do_remote_prefill"):
                self._callers[seq.seq_id] = caller
        return None

    def may_start(self, seq: Sequence) -> bool:
        """Whether a fresh prefill may start now: False while its caller already holds its budget of blocks
        under leases or reserved for prefills in flight (a caller holding nothing may always run one). Such a
        request waits in the queue, holding no KV, until decode reads the caller's leases or they expire, so
        a caller cannot hold most of the KV and a busy gateway is slowed, never refused."""
        caller = self._callers.get(seq.seq_id)
        if caller is None or seq.seq_id in self._reserved:
            return True
        held = self._caller_blocks.get(caller, 0)
        need = -(-seq.prompt_len // self.block_size)
        if held and held + need > self.lease_budget_blocks:
            return False
        del self._callers[seq.seq_id]
        self._reserved[seq.seq_id] = (caller, need)
        self._caller_blocks[caller] = held + need
        return True

    def _charge(self, caller: str | None, blocks: int) -> None:
        if caller is None:
            return
        left = self._caller_blocks.get(caller, 0) + blocks
        if left > 0:
            self._caller_blocks[caller] = left
        else:
            self._caller_blocks.pop(caller, None)

    def _lease_ended(self, lease: KVLease) -> None:
        self._charge(lease.caller, -len(lease.block_ids))

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._planned.pop(seq.seq_id, None)
        self._awaiting.pop(seq.seq_id, None)
        self._callers.pop(seq.seq_id, None)
        caller, reserved = self._reserved.pop(seq.seq_id, (None, 0))
        self._charge(caller, -reserved)
        params = seq.kv_transfer_params
        if not params:
            return False, None
        ended_well = seq.finish_reason not in ("abort", "error")
        if params.get("do_remote_prefill"):
            seq.kv_transfer_params = None  # consumed: never echo a peer's block ids back to the caller
            if seq.num_cached_tokens == 0 and self.handoff is not None:
                self._abandon(params, seq)  # finished (aborted) before its load began
            if self.config.bidirectional and ended_well:
                # Hold this turn's KV for the conversation's next prefill (prompt + output, no last token).
                return self._hold(seq, block_ids, seq.num_computed_tokens, self.config.decoder_ttl_s, for_prefill=True)
            return False, None
        if not params.get("do_remote_decode") or not ended_well:
            return False, None
        return self._hold(seq, block_ids, min(seq.num_computed_tokens, seq.prompt_len), None, for_prefill=False,
                          caller=caller)

    def _hold(self, seq: Sequence, block_ids: list[int], num_tokens: int, duration_s: float | None,
              for_prefill: bool, caller: str | None = None) -> tuple[bool, dict[str, Any] | None]:
        if num_tokens <= 0 or self.handoff is None:
            return False, None
        if seq.seq_id in self._lease_epochs:
            # The scheduler keys held requests by id: a second hold under the same id would orphan the first
            # one's blocks. Refuse the handoff instead (the peer then fails or recomputes by its policy).
            log.warning("request id %s already holds KV for a peer; not holding it twice", seq.seq_id)
            return False, None
        held = block_ids[:-(-num_tokens // self.block_size)]
        held_hash = token_hash(seq.token_ids[:num_tokens])
        lease = self.handoff.hold(seq.seq_id, held, duration_s, held_hash, caller)
        self._charge(caller, len(held))
        self._lease_epochs[seq.seq_id] = lease.epoch
        self._lease_requests[seq.seq_id] = seq.request_id
        if for_prefill:
            self._turn_holds[seq.seq_id] = lease.epoch
        return True, {
            # Decode's end-of-turn params describe its blocks; the caller sets do_remote_decode for prefill.
            "do_remote_prefill": not for_prefill,
            "do_remote_decode": False,
            "remote_block_ids": held,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": seq.seq_id,
            "remote_host": self._advertised_host,
            "remote_port": self.handoff.side_channel.port,
            "tp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_lease_epoch": lease.epoch,
            "remote_token_hash": held_hash,
        }

    def release_turn_hold(self) -> str | None:
        """Decode out of blocks: give up the oldest turn held for a conversation's next prefill (reuse only
        saves that prefill work; it recomputes without) rather than queue new requests behind unread holds.
        Returns the released request's id, whose blocks the caller frees; None when nothing can go."""
        while self._turn_holds and self.handoff is not None:
            seq_id, epoch = self._turn_holds.popitem(last=False)
            # reader "": refused while a prefill's READ has pinned the lease (its end frees it through poll)
            if self.handoff.leases.release(seq_id, epoch, reader="") is not None:
                self._lease_epochs.pop(seq_id, None)
                self._lease_requests.pop(seq_id, None)
                return seq_id
        return None

    def abort_held(self, request_id: str) -> list[str]:
        """Release the leases held under a request id (and its n > 1 children) that no decode has pinned: a
        decode hop that failed need not keep prefill's blocks for the whole lease. A pinned lease is being
        read; its READ notification frees it."""
        if self.handoff is None:
            return []
        freed = []
        for seq_id in [s for s, rid in self._lease_requests.items() if rid == request_id]:
            lease = self.handoff.leases.release(seq_id, self._lease_epochs[seq_id], reader="")
            if lease is not None:
                del self._lease_epochs[seq_id], self._lease_requests[seq_id]
                self._turn_holds.pop(seq_id, None)
                self._lease_ended(lease)
                freed.append(seq_id)
        return freed

    def _abandon(self, params: dict[str, Any], seq: Sequence) -> None:
        try:
            remote, _ = parse_remote(params, seq.prompt_token_ids, self.block_size)
        except BadTransferParams:
            return
        self._bound().abandon(remote)

    # -- progress ---------------------------------------------------------------------------------------

    def poll(self) -> ConnectorEvents:
        events = ConnectorEvents()
        events.failed_recving |= set(self._failed_now)
        events.refused_recving |= set(self._failed_now)  # params refused before any contact
        events.failure_reasons.update(self._failed_now)
        self._failed_now = {}
        if self.handoff is None:
            return events
        self._send_heartbeats()
        polled = self.handoff.poll()
        for lease in polled.freed:
            self._turn_holds.pop(lease.request_id, None)
            self.handoff.drop_source(lease.request_id)
            if self._lease_epochs.get(lease.request_id) == lease.epoch:
                del self._lease_epochs[lease.request_id]
                self._lease_requests.pop(lease.request_id, None)
                events.finished_sending.add(lease.request_id)
                self._lease_ended(lease)
        for outcome in polled.loads:
            (events.finished_recving if outcome.ok else events.failed_recving).add(outcome.request_id)
            if not outcome.ok:
                events.failure_reasons[outcome.request_id] = f"{outcome.reason}: {outcome.error}"
                if outcome.reason in REFUSED_REASONS:
                    events.refused_recving.add(outcome.request_id)
        return events

    def _send_heartbeats(self) -> None:
        handoff = self._bound()
        now = time.monotonic()
        for seq_id, (remote, due) in list(self._awaiting.items()):
            if now >= due:
                if handoff.heartbeat(remote):
                    self.heartbeats_sent += 1
                self._awaiting[seq_id] = (remote, now + self.heartbeat_interval_s)

    def has_inflight_transfers(self) -> bool:
        # Only decode loads need the engine loop at ~1 ms; held leases are progressed by the handoff's poller
        # thread, and the loop already re-polls every 10 ms while the scheduler holds blocks for a peer.
        return bool(self._failed_now) or (self.handoff is not None and self.handoff.loading() > 0)

    def stats(self) -> dict[str, float]:
        if self.handoff is None:
            return {}
        t = self.handoff.stats.totals
        return {"kv_transfer_reads": t["reads"], "kv_transfer_failures": t["failures"],
                "kv_transfer_bytes": t["bytes"], "kv_transfer_descriptors": t["descriptors"],
                "kv_transfer_seconds": t["seconds"], "kv_leased_blocks": self.handoff.leases.held_blocks(),
                "kv_leases": len(self.handoff.leases)}

    def render_metrics(self) -> bytes:
        return self.handoff.stats.metrics.render() if self.handoff is not None else b""

    def shutdown(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None


def warn_if_exposed(bind_host: str, port: int, secret: bytes | None) -> bool:
    """A side channel reachable beyond loopback without a secret hands this engine's NIXL metadata (enough to
    READ its KV pool) and its leases to anyone on the network: say so loudly at startup."""
    if secret or is_loopback(bind_host):
        return False
    log.warning("SECURITY: the KV side channel listens on %s:%d beyond loopback WITHOUT a secret: any host that "
                "reaches it gets this engine's NIXL metadata and can query and pin its KV leases. Set the same "
                "--kv-side-channel-secret (or SPLITSERVE_KV_SECRET) on every engine, and restrict the port to "
                "engine peers (docs/security.md)", bind_host or "*", port)
    return True
