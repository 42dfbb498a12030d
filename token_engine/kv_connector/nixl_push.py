"""NixlPushConnector (`"kv_connector": "NixlPushConnector"`, as upstream): push-mode P/D.

Decode gets kv_transfer_params naming the prefill engine and request instead of its blocks:
`do_remote_prefill`, `remote_engine_id`, `remote_host`, `remote_port` (prefill's side channel),
`remote_request_id` (the prefill request whose KV it wants) and optionally `prompt_token_ids`. It reserves
blocks for the part of the prompt its prefix cache does not hold, registers them (and the token hash of the
prompt) on prefill's side channel, and parks the request until prefill's `pushed` notification; then it
decodes. Params carrying `remote_block_ids` are pull params and are served as NixlConnector serves them
(bidirectional multi-turn reuse pulls decode's held turn that way), so one engine takes both.

Prefill (`do_remote_decode`, the same params as pull): after every engine step the connector tells the
handoff how far the prompt is computed, and the handoff WRITEs finished blocks into a reservation that
matches (push.py): one WRITE per prefill chunk while later chunks compute, the last with the notification.
The finished request's blocks are held under a lease as in pull mode (the same budgets, expiry, abort), so a
decode that registers late is still served, and the pull params are still returned.
"""

from __future__ import annotations

import logging

from token_engine.kv_connector.handoff_types import RemoteKV
from token_engine.kv_connector.nixl import BadTransferParams, NixlConnector, token_hash
from token_engine.kv_connector.push import WINDOW_MARGIN_S

log = logging.getLogger("token_engine.kv_transfer")
MAX_REQUEST_ID_CHARS = 256


def is_push_params(params: dict) -> bool:
    return bool(params.get("do_remote_prefill")) and params.get("remote_block_ids") is None


def parse_push(params: dict, prompt_token_ids: list[int]) -> RemoteKV:
    """The producer named by decode-side push params, validated (the params are untrusted)."""
    def need(key, typ):
        v = params.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise BadTransferParams(f"kv_transfer_params.{key} missing or not a {typ.__name__}")
        return v

    engine_id, host = need("remote_engine_id", str), need("remote_host", str)
    request_id, port = need("remote_request_id", str), need("remote_port", int)
    if not 0 < port < 65536 or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS or len(engine_id) > 256:
        raise BadTransferParams("kv_transfer_params.remote_port or remote_request_id out of range")
    if params.get("tp_size", 1) != 1:
        raise BadTransferParams("only tp_size 1 is supported")
    echoed = params.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_token_ids:
        raise BadTransferParams("kv_transfer_params.prompt_token_ids differ from the request's prompt")
    # epoch 0: the producer's incarnation is not known here, the blocks are ours
    return RemoteKV(engine_id, host, port, request_id, 0, (), token_hash(prompt_token_ids))


class NixlPushConnector(NixlConnector):
    def __init__(self, kv_transfer_config: dict, engine_config=None):
        super().__init__(kv_transfer_config, engine_config)
        if self.config.load_timeout_s <= 2 * WINDOW_MARGIN_S:
            raise ValueError(f"kv_connector_extra_config.kv_load_timeout must exceed {2 * WINDOW_MARGIN_S:g} s in "
                             "push mode: prefill stops writing that long before decode's deadline")
        self._pushing: dict = {}  # prefill: seq_id -> Sequence whose KV is pushed as it is computed
        self._push_planned: dict[str, tuple[RemoteKV | None, int, str]] = {}  # decode: seq_id -> plan

    # -- decode ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> tuple[int, bool]:
        params = seq.kv_transfer_params
        if not params or not is_push_params(params):
            return super().get_num_new_matched_tokens(seq, num_computed_tokens)
        try:
            remote = parse_push(params, seq.prompt_token_ids)
        except BadTransferParams as e:
            if self.load_failure_policy == "recompute":
                log.warning("request %s: %s; computing the prompt locally", seq.seq_id, e)
                return 0, False
            self._push_planned[seq.seq_id] = (None, num_computed_tokens, str(e))
            return max(1, seq.prompt_len - num_computed_tokens), True
        external = seq.prompt_len - num_computed_tokens
        if external <= 0:
            return 0, False
        self._push_planned[seq.seq_id] = (remote, num_computed_tokens, "")
        return external, True

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        plan = self._push_planned.pop(seq.seq_id, None)
        if plan is None:
            return super().update_state_after_alloc(seq, block_ids, num_external_tokens)
        remote, num_computed, error = plan
        if remote is None:
            self._failed_now[seq.seq_id] = f"invalid kv_transfer_params: {error}"
            return
        first = num_computed // self.block_size
        local_ids = block_ids[first:-(-seq.prompt_len // self.block_size)]
        assert self.handoff is not None  # bound before any request
        try:
            self.handoff.start_push(seq.seq_id, remote, local_ids, first, seq.prompt_len)
        except Exception as e:  # noqa: BLE001 - any refusal is a failed load, never an engine crash
            log.warning("push reservation for %s refused: %s", seq.seq_id, e)
            self._failed_now[seq.seq_id] = f"load refused: {e}"

    # -- prefill --------------------------------------------------------------------------------------

    def admit(self, seqs, caller: str | None) -> str | None:
        refusal = super().admit(seqs, caller)
        if refusal is None:
            for seq in seqs:
                p = seq.kv_transfer_params
                if p and p.get("do_remote_decode") and not p.get("do_remote_prefill"):
                    self._pushing[seq.seq_id] = seq
        return refusal

    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._push_planned.pop(seq.seq_id, None)
        if self.handoff is not None and seq.kv_transfer_params and is_push_params(seq.kv_transfer_params):
            self.handoff.cancel_load(seq.seq_id)  # aborted while waiting: withdraw the reservation
        pushing = self._pushing.pop(seq.seq_id, None)
        delay_free, params = super().request_finished(seq, block_ids)
        if pushing is not None and self.handoff is not None:
            epoch = self._lease_epochs.get(seq.seq_id) if delay_free else None
            self.handoff.push_source(seq.seq_id, block_ids, seq.prompt_token_ids, seq.prompt_len,
                                     lease=(seq.seq_id, epoch) if epoch is not None else None, aborted=epoch is None)
        return delay_free, params

    def poll(self):
        if self.handoff is not None:
            for seq_id, seq in self._pushing.items():
                # preempted: blocks an earlier WRITE read from may be reused meanwhile, so that push fails
                self.handoff.push_source(seq_id, seq.block_table, seq.prompt_token_ids,
                                         min(seq.num_computed_tokens, seq.prompt_len),
                                         aborted=seq.num_preemptions > 0)
        return super().poll()

    def has_inflight_transfers(self) -> bool:
        return super().has_inflight_transfers() or bool(self._pushing)
