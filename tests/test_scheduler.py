"""Scheduler decisions without a model: token budget, chunking, priorities, preemption, the connector seam."""

from __future__ import annotations

import itertools

from token_engine.core.kv_cache import BlockManager
from token_engine.core.scheduler import Scheduler, SchedulerOutput
from token_engine.core.sequence import SamplingOptions, Sequence, SequenceStatus
from token_engine.kv_connector.base import ConnectorEvents, NoOpKVConnector

_ids = itertools.count()


def seq(n_prompt: int, priority: int = 0, max_tokens: int = 100, name: str | None = None) -> Sequence:
    name = name or f"s{next(_ids)}"
    return Sequence(seq_id=name, request_id=name, index=0, prompt_token_ids=[7] * n_prompt,
                    options=SamplingOptions(max_tokens=max_tokens, ignore_eos=True), priority=priority)


def make(num_blocks=32, block_size=4, max_num_seqs=8, budget=64, max_model_len=128, connector=None):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, connector), bm


def step(s: Scheduler, token: int = 1) -> SchedulerOutput:
    """One schedule + a pretend model run that samples `token` for every sequence that samples."""
    out = s.schedule()
    s.update_after_step(out, {x.seq.seq_id: token for x in out.scheduled if x.samples})
    return out


def test_budget_splits_a_long_prompt_into_chunks_and_only_the_last_chunk_samples():
    s, _ = make(budget=10)
    a = seq(25)
    s.add(a)
    chunks = [step(s).scheduled[0] for _ in range(3)]
    assert [c.num_new_tokens for c in chunks] == [10, 10, 5]
    assert [c.samples for c in chunks] == [False, False, True]
    assert a.num_output_tokens == 1


def test_running_decodes_come_before_new_prefills_and_share_the_budget():
    s, _ = make(budget=8)
    a = seq(3)
    s.add(a)
    step(s)
    b = seq(20)
    s.add(b)
    out = step(s)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 1), (b, 7)]
    assert sum(x.num_new_tokens for x in out.scheduled) == 8  # within max_num_batched_tokens


def test_max_num_seqs_caps_the_running_batch():
    s, _ = make(max_num_seqs=2)
    seqs = [seq(2) for _ in range(3)]
    for x in seqs:
        s.add(x)
    out = step(s)
    assert [x.seq for x in out.scheduled] == seqs[:2]
    assert s.waiting == [seqs[2]]


def test_waiting_queue_orders_by_priority_then_arrival():
    s, _ = make(max_num_seqs=1)
    late, urgent, normal, urgent2 = seq(2, 3), seq(2, -2), seq(2, 0), seq(2, -2)
    for x in (late, urgent, normal, urgent2):
        s.add(x)
    assert s.waiting == [urgent, urgent2, normal, late]


def test_out_of_blocks_preempts_the_lowest_priority_running_sequence_and_it_resumes_by_recompute():
    s, bm = make(num_blocks=4, block_size=4, budget=64, max_model_len=16)
    high, low = seq(6, priority=0), seq(6, priority=1)
    s.add(high)
    s.add(low)
    step(s)  # both prefilled: 2 blocks each, pool full; each now has 7 tokens
    step(s)
    step(s)  # positions 6 and 7 computed: 2 blocks each still; 9 tokens each
    out = step(s)  # position 8 of `high` needs a third block: `low` must give its blocks up
    assert out.preempted == [low]
    assert low.status is SequenceStatus.WAITING and low.block_table == [] and low.num_computed_tokens == 0
    assert low.num_output_tokens == 3  # generated tokens are kept and recomputed, not lost
    assert [x.seq for x in out.scheduled] == [high]
    s.finish(high, "stop")
    out = step(s)
    assert out.scheduled[0].seq is low and out.scheduled[0].num_new_tokens == 9  # prompt + outputs recomputed
    s.finish(low, "stop")
    assert bm.num_free_blocks() == 4


def test_the_lowest_priority_sequence_that_cannot_grow_preempts_itself():
    s, _ = make(num_blocks=4, block_size=4, max_model_len=16)
    high, low = seq(5, priority=0), seq(8, priority=1)
    s.add(high)
    s.add(low)
    step(s)  # 2 blocks each, pool full
    out = step(s)  # high still fits its second block; low's position 8 needs a third and nobody ranks below it
    assert out.preempted == [low]
    assert [x.seq for x in out.scheduled] == [high]
    assert s.waiting == [low]


def test_generation_ends_at_max_model_len():
    s, _ = make(num_blocks=2, block_size=4, max_model_len=8)
    a = seq(4)
    s.add(a)
    for _ in range(4):
        step(s)
    assert a.finish_reason == "length" and a.num_tokens == 8


def test_finish_by_max_tokens_and_block_return():
    s, bm = make()
    a = seq(5, max_tokens=3)
    s.add(a)
    for _ in range(3):
        step(s)
    assert a.is_finished and a.finish_reason == "length" and a.num_output_tokens == 3
    assert bm.num_free_blocks() == bm.num_blocks
    assert not s.has_work()


def test_abort_of_a_waiting_sequence_removes_it():
    s, bm = make(max_num_seqs=1)
    a, b = seq(3), seq(3)
    s.add(a)
    s.add(b)
    step(s)
    s.abort(b)
    assert b.finish_reason == "abort" and b not in s.waiting
    s.abort(a)
    assert bm.num_free_blocks() == bm.num_blocks and not s.has_work()


class RemotePrefillConnector(NoOpKVConnector):
    """A connector whose peer holds every prompt token but the last, loaded asynchronously."""

    def __init__(self, policy="fail", delay_free=False):
        self.load_failure_policy = policy
        self.delay_free = delay_free
        self.allocated = {}
        self.events = ConnectorEvents()
        self.finished = []

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        return seq.prompt_len - num_computed_tokens, True

    def update_state_after_alloc(self, seq, block_ids, num_external_tokens):
        self.allocated[seq.seq_id] = (list(block_ids), num_external_tokens)

    def request_finished(self, seq, block_ids):
        self.finished.append((seq.seq_id, list(block_ids)))
        return self.delay_free, {"remote_block_ids": list(block_ids)}

    def poll(self):
        events, self.events = self.events, ConnectorEvents()
        return events


def test_async_remote_load_parks_the_sequence_until_the_connector_reports_it_loaded():
    conn = RemotePrefillConnector()
    s, bm = make(connector=conn)
    a = seq(10)
    s.add(a)
    assert step(s).scheduled == []
    assert a.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    blocks, external = conn.allocated[a.seq_id]
    assert external == 10 and len(blocks) == 3 and blocks == a.block_table
    assert step(s).scheduled == []  # nothing until the load is reported
    conn.events.finished_recving.add(a.seq_id)
    s.apply_connector_events(conn.poll())
    out = step(s)
    assert [(x.seq, x.num_new_tokens, x.samples) for x in out.scheduled] == [(a, 1, True)]  # only the last token
    assert a.num_cached_tokens == 10


def test_failed_remote_load_with_recompute_policy_computes_the_prompt_locally():
    conn = RemotePrefillConnector(policy="recompute")
    s, bm = make(connector=conn)
    a = seq(10)
    s.add(a)
    step(s)
    conn.events.failed_recving.add(a.seq_id)
    s.apply_connector_events(conn.poll())
    out = step(s)
    assert out.scheduled[0].seq is a and out.scheduled[0].num_new_tokens == 10


def test_failed_remote_load_with_fail_policy_errors_the_request_and_frees_blocks():
    conn = RemotePrefillConnector(policy="fail")
    s, bm = make(connector=conn)
    a = seq(10)
    s.add(a)
    step(s)
    conn.events.failed_recving.add(a.seq_id)
    finished = s.apply_connector_events(conn.poll())
    assert finished == [a] and a.finish_reason == "error" and a.error
    assert bm.num_free_blocks() == bm.num_blocks


def test_abort_during_a_remote_load_frees_blocks_only_once_the_transfer_reports_back():
    conn = RemotePrefillConnector()
    s, bm = make(connector=conn)
    a = seq(10)
    s.add(a)
    step(s)
    s.abort(a)
    assert bm.num_free_blocks() < bm.num_blocks  # the peer may still be writing into them
    conn.events.finished_recving.add(a.seq_id)
    s.apply_connector_events(conn.poll())
    assert bm.num_free_blocks() == bm.num_blocks and not s.has_work()


def test_connector_may_hold_finished_blocks_until_the_peer_has_read_them():
    conn = RemotePrefillConnector(delay_free=True)
    conn.get_num_new_matched_tokens = lambda seq, n: (0, False)  # a prefill-side engine computes locally
    s, bm = make(connector=conn)
    a = seq(6, max_tokens=1)
    s.add(a)
    step(s)
    assert a.is_finished and a.kv_transfer_params_out == {"remote_block_ids": a.block_table}
    assert conn.finished == [(a.seq_id, a.block_table)]
    assert bm.num_free_blocks() == bm.num_blocks - 2
    conn.events.finished_sending.add(a.seq_id)
    s.apply_connector_events(conn.poll())
    assert bm.num_free_blocks() == bm.num_blocks
