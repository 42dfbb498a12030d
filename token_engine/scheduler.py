"""Who decides what runs next: waiting/running queues, chunked prefill under a per-step token budget,
preemption by recompute when blocks run out, priorities (lower value first, then arrival, as vLLM).

Each step is one mixed batch: running sequences first (a decode token each, or the next chunk of an
unfinished prefill), then waiting sequences in priority order while the token budget, `max_num_seqs` and
the free blocks allow. A running sequence that cannot get a block preempts the lowest-priority running
sequence (possibly itself): its blocks are freed and it re-enters the waiting queue to be recomputed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from token_engine.kv_cache import BlockManager
from token_engine.kv_connector.base import (
    KV_LOAD_FAILED,
    KV_PARAMS_REFUSED,
    ConnectorEvents,
    KVConnector,
    NoOpKVConnector,
)
from token_engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # True when this chunk reaches the end of the sequence's known tokens, so a token is sampled.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


GRAMMAR_VIOLATION = ("structured_outputs: the sampled token is not allowed by the grammar (another constraint, "
                     "such as allowed_token_ids or min_tokens, left no token the grammar accepts)")


def check_stop(seq: Sequence, max_model_len: int) -> str | None:
    """The finish reason after seq's last appended token, or None to continue."""
    opts = seq.options
    token = seq.token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= opts.min_tokens:
        if token in opts.stop_token_ids or (not opts.ignore_eos and token in seq.eos_token_ids):
            return "stop"
    if seq.grammar is not None:
        if seq.grammar.violated:
            return "error"
        if seq.grammar.terminated:  # complete, and nothing may follow
            return "stop"
    if n_out >= opts.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        connector: KVConnector | None = None,
    ):
        self.bm = block_manager
        self.connector = connector or NoOpKVConnector()
        # where the connector's tokens come from, for per-tier metrics (a NIXL peer: "p2p")
        self._has_external_tier = not isinstance(self.connector, NoOpKVConnector)
        self._external_source: str = getattr(self.connector, "cache_source", "external_unspecified")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.waiting_for_remote: dict[str, Sequence] = {}
        self.held_by_connector: dict[str, Sequence] = {}  # finished; blocks kept until the peer read them
        self._pending_external: dict[str, int] = {}  # seq_id -> tokens being loaded by the connector
        self._aborted_while_loading: set[str] = set()
        self._remote_checked: set[str] = set()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End seq; its blocks go back unless the connector holds them for a peer."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.grammar = None  # the matcher's memory goes back with the blocks
        self._remote_checked.discard(seq.seq_id)
        delay_free, params = self.connector.request_finished(seq, list(seq.block_table))
        seq.kv_transfer_params_out = params
        if seq.seq_id in self.waiting_for_remote:
            # A transfer may still be writing into these blocks: free them when it reports back.
            self._aborted_while_loading.add(seq.seq_id)
        elif delay_free:
            self.held_by_connector[seq.seq_id] = seq
        else:
            self.bm.free_blocks(seq)

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_blocks(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _release_turn_hold(self) -> bool:
        """Out of blocks: free the oldest turn the connector holds only for a possible next-turn reuse (before
        refusing or preempting anyone; unread holds would otherwise fill the pool until their TTL)."""
        seq_id = self.connector.release_turn_hold()
        if seq_id is None:
            return False
        self.release_held(seq_id)
        return True

    def release_held(self, seq_id: str) -> None:
        """The connector let go of a finished sequence's blocks (its lease ended early): free them."""
        held = self.held_by_connector.pop(seq_id, None)
        if held is not None:
            self.bm.free_blocks(held)

    # ---- connector events -------------------------------------------------------------------------
    def apply_connector_events(self, events: ConnectorEvents) -> list[Sequence]:
        """Move loaded sequences back to waiting, handle failures, free blocks peers are done with.
        Returns sequences that finished because of these events (failed loads under policy "fail")."""
        finished = []
        for seq_id in events.finished_sending:
            seq = self.held_by_connector.pop(seq_id, None)
            if seq is not None:
                self.bm.free_blocks(seq)
        for seq_id in events.finished_recving | events.failed_recving:
            seq = self.waiting_for_remote.pop(seq_id, None)
            if seq is None:
                continue
            external = self._pending_external.pop(seq_id, 0)
            if seq_id in self._aborted_while_loading:
                self._aborted_while_loading.discard(seq_id)
                self.bm.free_blocks(seq)
                continue
            if seq_id in events.finished_recving and seq_id not in events.failed_recving:
                # Keep at least one token to compute: its logits give the next token.
                seq.num_computed_tokens = min(seq.num_computed_tokens + external, seq.num_tokens - 1)
                self.add(seq)
            elif self.connector.load_failure_policy == "recompute":
                self.bm.free_blocks(seq)  # possibly half-written: never published, recomputed from scratch
                self.add(seq)
            else:
                seq.status = SequenceStatus.WAITING  # not in any queue; finish() frees it
                self.waiting.append(seq)
                why = events.failure_reasons.get(seq_id, "the remote engine's KV cache could not be loaded")
                prefix = KV_PARAMS_REFUSED if seq_id in events.refused_recving else KV_LOAD_FAILED
                self.finish(seq, "error", f"{prefix}: {why}")
                finished.append(seq)
        return finished

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda s: s.sort_key)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, num_new):
                if self._release_turn_hold():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq preempted itself: it was the last one

        # New work only when nothing had to be preempted this step (as vLLM): blocks are short.
        i = 0
        while not out.preempted and i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if not seq.block_table and not self.connector.may_start(seq):
                i += 1  # its caller holds its share of leased KV: it waits, the ones behind it may start
                continue
            num_scheduled = self._admit(i, budget, out)
            if num_scheduled is None:
                break
            budget -= num_scheduled
        return out

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        return ScheduledSequence(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)

    def _admit(self, index: int, budget: int, out: SchedulerOutput) -> int | None:
        """Start (or resume) waiting[index]; the tokens it got, or None if it must wait."""
        seq = self.waiting[index]
        cached: list[int] = []
        offloaded: list[bytes] = []  # blocks the host tier holds right after the device hits
        external, load_async = 0, False
        fresh = not seq.block_table
        if fresh:
            # Cached tokens would have no prompt logprobs.
            if seq.options.prompt_logprobs is None and not seq.options.skip_prefix_cache:
                cached = self.bm.find_cached_prefix(seq)
                offloaded = self.bm.find_offloaded_prefix(seq, len(cached))
            num_computed = (len(cached) + len(offloaded)) * self.bm.block_size
            if seq.seq_id not in self._remote_checked:
                self._remote_checked.add(seq.seq_id)
                external, load_async = self.connector.get_num_new_matched_tokens(seq, num_computed)
                external = max(0, min(external, seq.num_tokens - num_computed))
        else:
            num_computed = seq.num_computed_tokens
        remaining = seq.num_tokens - num_computed - external
        num_new = 0 if load_async else min(remaining, budget)
        if not load_async and external and num_new == 0:
            # A synchronous peer covered everything: recompute the last token for its logits.
            external -= 1
            num_new = 1
        if fresh:
            host_tokens = len(offloaded) * self.bm.block_size
            while not self.bm.can_admit(seq, cached, host_tokens + external + num_new):
                if not self._release_turn_hold():
                    self._remote_checked.discard(seq.seq_id)  # the next attempt must ask the connector again
                    return None
            self.bm.take_cached_blocks(seq, cached)
            self.bm.load_offloaded(seq, offloaded)
            if seq.num_preemptions == 0:
                self.bm.record_prefix_lookup(seq.num_tokens, len(cached) * self.bm.block_size)
                if self._has_external_tier or self.bm.host is not None:
                    self.bm.record_external_lookup(seq.num_tokens, {"host": host_tokens,
                                                                    self._external_source: external})
                seq.num_cached_tokens = len(cached) * self.bm.block_size + host_tokens + external
        if not self.bm.allocate(seq, external + num_new):
            if fresh:
                self.bm.free_blocks(seq)
                self._remote_checked.discard(seq.seq_id)
            return None
        self.waiting.pop(index)
        if external:
            self.connector.update_state_after_alloc(seq, list(seq.block_table), external)
        if load_async:
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote[seq.seq_id] = seq
            self._pending_external[seq.seq_id] = external
            return 0
        seq.num_computed_tokens += external
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(self._scheduled(seq, num_new))
        return num_new

    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advance computed counts, publish full blocks, append sampled tokens; returns newly finished."""
        finished = []
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens += s.num_new_tokens
            self.bm.cache_computed_blocks(seq)
            if s.samples and seq.seq_id in sampled:
                seq.append_token(sampled[seq.seq_id])
                reason = check_stop(seq, self.max_model_len)
                token = seq.token_ids[-1]
                if reason == "stop" and (token in seq.options.stop_token_ids or token in seq.eos_token_ids):
                    seq.stop_reason = token  # not when a grammar ended it without a stop token
                if reason is not None:
                    self.finish(seq, reason, GRAMMAR_VIOLATION if reason == "error" else None)
                    finished.append(seq)
        return finished
