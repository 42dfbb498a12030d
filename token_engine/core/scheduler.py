"""Who decides what runs next: waiting/running queues, chunked prefill under a per-step token budget,
preemption by recompute when blocks run out, priorities (lower value first, then arrival, as vLLM).

Each step is one mixed batch: running sequences first (decode tokens, then the next chunks of unfinished
prefills), then waiting sequences in priority order while the token budget, `max_num_seqs` and the free
blocks allow. The budget and a cap on long chunks come from token_engine.core.step_budget (stall-free batching).
A running sequence that cannot get a block preempts the lowest-priority running
sequence (possibly itself): its blocks are freed and it re-enters the waiting queue to be recomputed.

A sequence whose KV is being copied in, by the connector from a peer (an asynchronous NIXL load) or from the
host tier (blocks the device pool evicted), waits in WAITING_FOR_REMOTE_KVS with its blocks allocated: it is
in no step until every load it started reports back (`apply_connector_events`, `apply_host_loads`, polled
each step without waiting); then its loaded tokens count as computed and it queues again, so the other
sequences' steps never wait for its copies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from token_engine.core.kv_cache import BlockManager
from token_engine.core.sequence import Sequence, SequenceStatus
from token_engine.core.step_budget import (
    BucketStepTimes,
    PrefillPolicy,
    StepTimeModel,
    attention_pairs,
    fill_bucket,
)
from token_engine.kv_connector.base import (
    KV_LOAD_FAILED,
    KV_PARAMS_REFUSED,
    ConnectorEvents,
    KVConnector,
    NoOpKVConnector,
)
from token_engine.rl.group_prefill import prefills_in_flight, share_key, waits_for_group_prefill

if TYPE_CHECKING:
    from token_engine.kv_offload.host_tier import HostLoad


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


@dataclass(eq=False)
class PendingLoad:
    """What a sequence in WAITING_FOR_REMOTE_KVS waits for: the connector's transfer, a host-tier load, or
    both (host blocks first, the peer's after them). It moves on once neither is under way."""

    external: int = 0  # tokens the connector writes
    remote: bool = False  # the connector's transfer is under way
    host: HostLoad | None = None  # the host tier's copies, until reported finished
    host_tokens: int = 0
    failure: str | None = None  # why the connector's transfer failed
    refused: bool = False  # ... because the caller's kv_transfer_params were refused
    aborted: bool = False  # finished while loading: its blocks are freed once nothing writes them

    @property
    def under_way(self) -> bool:
        return self.remote or self.host is not None


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
        policy: PrefillPolicy | None = None,
    ):
        self.bm = block_manager
        self.policy = policy or PrefillPolicy()
        self.step_times = StepTimeModel()
        # Token counts the runner pads mixed steps to (its CUDA graphs); empty: steps are not padded.
        self.step_token_buckets: tuple[int, ...] = ()
        # Those buckets' step times as the runner measured them: the step budget plans with them when set.
        self.bucket_times: BucketStepTimes | None = None
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
        self.loading: dict[str, PendingLoad] = {}  # seq_id -> what a sequence in waiting_for_remote waits for
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
            # A transfer or a host load may still be writing into these blocks: free them when it reports back.
            self.loading[seq.seq_id].aborted = True
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
            load = self.loading.get(seq_id)
            if load is None or not load.remote:
                continue
            load.remote = False
            if seq_id not in events.finished_recving or seq_id in events.failed_recving:
                load.failure = events.failure_reasons.get(seq_id, "the remote engine's KV cache could not be loaded")
                load.refused = seq_id in events.refused_recving
            if (seq := self._loaded(seq_id)) is not None:
                finished.append(seq)
        return finished

    def apply_host_loads(self) -> list[Sequence]:
        """Moves on the sequences whose host-tier loads finished (asks the tier, never waits); returns those
        that finished because of it (a peer's failed load under policy "fail" that only waited for the host)."""
        finished: list[Sequence] = []
        if self.bm.host is None:
            return finished
        for host_load in self.bm.host.finished_loads():
            load = self.loading.get(host_load.owner)
            if load is None or load.host is not host_load:
                continue
            load.host = None
            if (seq := self._loaded(host_load.owner)) is not None:
                finished.append(seq)
        return finished

    def _loaded(self, seq_id: str) -> Sequence | None:
        """One of seq_id's loads reported back: once none is under way, it queues again with its loaded tokens
        computed (or is freed, recomputed or failed). Returns it if it finished now."""
        load = self.loading[seq_id]
        if load.under_way:
            return None
        del self.loading[seq_id]
        seq = self.waiting_for_remote.pop(seq_id)
        if load.aborted:
            self.bm.free_blocks(seq)
            return None
        if load.failure is None:
            seq.num_computed_tokens += load.host_tokens
            self.bm.cache_computed_blocks(seq)  # the host tier's blocks hold their KV now: others may hit them
            # Keep at least one token to compute: its logits give the next token.
            seq.num_computed_tokens = min(seq.num_computed_tokens + load.external, seq.num_tokens - 1)
            self.add(seq)
            return None
        if self.connector.load_failure_policy == "recompute":
            self.bm.free_blocks(seq)  # possibly half-written: never published, recomputed from scratch
            self.add(seq)
            return None
        seq.status = SequenceStatus.WAITING  # not in any queue; finish() frees it
        self.waiting.append(seq)
        prefix = KV_PARAMS_REFUSED if load.refused else KV_LOAD_FAILED
        self.finish(seq, "error", f"{prefix}: {load.failure}")
        return seq

    # ---- the step ---------------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float, out: SchedulerOutput | None = None) -> None:
        """The model time of a step that ran num_tokens (`out`: what it scheduled, before update_after_step,
        for its prefill attention): feeds the step budget."""
        pairs = 0.0
        context = -1  # no prefill in the step
        for s in out.scheduled if out is not None else ():
            if s.num_new_tokens > 1:
                pairs += attention_pairs(s.num_new_tokens, s.seq.num_computed_tokens)
                context = max(context, s.seq.num_computed_tokens)
        self.step_times.observe(num_tokens, seconds * 1e3, pairs)
        if self.bucket_times is not None and context >= 0:
            self.bucket_times.observe(num_tokens, context, seconds * 1e3)

    def step_budget(self) -> int:
        """This step's token budget: max_num_batched_tokens, or less while sequences decode and a step-time
        target is set (the decode tokens always fit; prefill gets at least min_prefill_tokens)."""
        budget = self.max_num_batched_tokens
        target = self.policy.target_step_ms
        if target <= 0:
            return budget
        decoding = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        if decoding == 0:
            return budget  # nobody waits for a token between steps
        # The context the step's prefill extends: the furthest-along prompt being chunked (the one a long prompt's
        # chunks come from; a new prompt starts after its cached prefix, which this leaves out).
        context = max((s.num_computed_tokens for s in self.running if s.num_tokens - s.num_computed_tokens > 1),
                      default=0)
        floor = decoding + self.policy.min_prefill_tokens
        if self.bucket_times is not None:
            return min(budget, self.bucket_times.tokens_for(target, context, floor))
        fitted = self.step_times.tokens_for(target, decoding, context)
        if fitted is None:
            return budget
        tokens = max(fitted, floor)
        if self.step_token_buckets:
            tokens = fill_bucket(tokens, floor, self.step_token_buckets)
        return min(budget, tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.step_budget()
        cap = self.policy.chunk_cap(budget, len(self.running) + len(self.waiting))
        self.running.sort(key=lambda s: s.sort_key)
        # Decode tokens first, then chunks of short prefills, then new prompts, then chunks of long prefills
        # (remaining > long_prefill_token_threshold, when set): a long prompt fills what the others leave, so
        # neither a decoding stream nor a short prompt arriving meanwhile waits behind it. Each group goes by
        # priority; preemption still takes the lowest-priority running sequence.
        threshold = self.policy.long_prefill_token_threshold

        def is_long(s: Sequence) -> bool:
            return threshold > 0 and s.num_tokens - s.num_computed_tokens > threshold

        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.sort_key))
        placed: dict[str, ScheduledSequence] = {}
        budget = self._schedule_running([s for s in order if not is_long(s)], budget, cap, placed, out)

        # New work only when nothing had to be preempted this step (as vLLM): blocks are short.
        in_flight = prefills_in_flight(self.bm, self.running + self._loading_from_host()) if self.waiting else set()
        for seq in self._admission_order():
            if out.preempted or budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not seq.block_table and not self.connector.may_start(seq):
                continue  # its caller holds its share of leased KV: it waits, the ones behind it may start
            if waits_for_group_prefill(self.bm, seq, in_flight):
                continue  # a sibling is computing this prompt's KV: take it from the cache next step
            num_scheduled = self._admit(self.waiting.index(seq), min(budget, cap) if cap else budget, out)
            if num_scheduled is None:
                break
            budget -= num_scheduled
            if (key := share_key(self.bm, seq)) is not None and seq.num_computed_tokens < seq.prompt_len:
                in_flight.add(key)
        self._schedule_running([s for s in order if is_long(s)], budget, cap, placed, out)
        return out

    def _loading_from_host(self) -> list[Sequence]:
        """Sequences whose prompt blocks the host tier is copying in (a sibling waits for them, as for a prefill)."""
        return [self.waiting_for_remote[seq_id] for seq_id, load in self.loading.items()
                if load.host is not None and not load.aborted]

    def _schedule_running(self, seqs: list[Sequence], budget: int, cap: int,
                          placed: dict[str, ScheduledSequence], out: SchedulerOutput) -> int:
        """Gives running sequences their tokens in the given order; returns the budget left."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if cap and num_new > 1:
                num_new = min(num_new, cap)
            while not self.bm.allocate(seq, num_new):
                if self._release_turn_hold():
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                given = placed.pop(victim.seq_id, None)
                if given is not None:  # it had its tokens already: they go back to the budget
                    out.scheduled.remove(given)
                    budget += given.num_new_tokens
                if victim is seq:
                    break
            else:
                placed[seq.seq_id] = self._scheduled(seq, num_new)
                out.scheduled.append(placed[seq.seq_id])
                budget -= num_new
        return budget

    def _admission_order(self) -> list[Sequence]:
        """Waiting sequences in the order they are offered a start: priority order, except that within the
        first cache_aware_admission_window fresh ones, those with a cached prefix go first once the cache is
        at least cache_aware_admission_threshold full (a cold prompt would evict what a warm one needs)."""
        window = self.policy.cache_aware_admission_window
        if window <= 0 or self.bm.usage() < self.policy.cache_aware_admission_threshold:
            return list(self.waiting)
        head = self.waiting[:window]
        movable = [i for i, s in enumerate(head) if not s.block_table and s.num_computed_tokens == 0]
        warm = [i for i in movable if self.bm.find_cached_prefix(head[i])]
        cold = [i for i in movable if i not in warm]
        reordered = list(head)
        for slot, i in zip(movable, warm + cold):  # only the movable positions change hands
            reordered[slot] = head[i]
        return reordered + self.waiting[window:]

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
        loads = load_async or bool(offloaded)  # it waits for copies into its blocks before it runs
        limit = self.policy.max_num_inflight_kv_loads
        if loads and limit is not None and len(self.waiting_for_remote) >= limit:
            self._remote_checked.discard(seq.seq_id)  # asked again once a load finishes
            return None
        remaining = seq.num_tokens - num_computed - external
        num_new = 0 if loads else min(remaining, budget)
        if not loads and external and num_new == 0:
            # A synchronous peer covered everything: recompute the last token for its logits.
            external -= 1
            num_new = 1
        host_tokens = len(offloaded) * self.bm.block_size
        if fresh:
            while not self.bm.can_admit(seq, cached, host_tokens + external + num_new):
                if not self._release_turn_hold():
                    self._remote_checked.discard(seq.seq_id)  # the next attempt must ask the connector again
                    return None
            self.bm.take_cached_blocks(seq, cached)
            if seq.num_preemptions == 0:
                self.bm.record_prefix_lookup(seq.num_tokens, len(cached) * self.bm.block_size)
                if self._has_external_tier or self.bm.host is not None:
                    self.bm.record_external_lookup(seq.num_tokens, {"host": host_tokens,
                                                                    self._external_source: external})
                seq.num_cached_tokens = len(cached) * self.bm.block_size + host_tokens + external
        host_load: HostLoad | None = None
        if offloaded:  # blocks for the host tier's hits and what follows them; the hits' copies start
            host_load = self.bm.load_from_host(seq, offloaded, external + num_new)
            allocated = host_load is not None
        else:
            allocated = self.bm.allocate(seq, external + num_new)
        if not allocated:
            if fresh:
                self.bm.free_blocks(seq)
                self._remote_checked.discard(seq.seq_id)
            return None
        self.waiting.pop(index)
        if external:
            if self.bm.host is not None:  # a peer's transfer writes the new blocks outside stream order
                self.bm.host.fence(host=True)
            self.connector.update_state_after_alloc(seq, list(seq.block_table), external)
        if loads:
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote[seq.seq_id] = seq
            self.loading[seq.seq_id] = PendingLoad(external, load_async, host_load, host_tokens)
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
