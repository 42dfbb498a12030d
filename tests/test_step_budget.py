"""Stall-free chunked prefill and vLLM's long-prompt knobs in the scheduler (no model: a pretend step)."""

from __future__ import annotations

import pytest

from tests.test_scheduler import seq, step
from token_engine.core.kv_cache import BlockManager
from token_engine.core.scheduler import Scheduler
from token_engine.core.step_budget import BucketStepTimes, PrefillPolicy, StepTimeModel, attention_pairs


def make(policy: PrefillPolicy, budget=512, num_blocks=2048, block_size=4, max_num_seqs=16, caching=False):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, budget, 4096, policy=policy), bm


def decoding(s: Scheduler, n: int, prompt: int = 3):
    seqs = [seq(prompt, max_tokens=1000) for _ in range(n)]
    for x in seqs:
        s.add(x)
    step(s)  # prompts done: every one decodes from now on
    return seqs


def test_step_time_model_recovers_a_linear_cost_and_budgets_tokens_for_a_target():
    model = StepTimeModel()
    assert model.tokens_for(30.0) is None  # nothing seen yet
    for tokens in (8, 300, 40, 900, 2000, 16):
        model.observe(tokens, 7.0 + 0.01 * tokens)
    base, per_token = model.fit()
    assert base == pytest.approx(7.0) and per_token == pytest.approx(0.01)
    assert model.tokens_for(30.0) == pytest.approx(2300, abs=1)


def cost_with_context(tokens: int, pairs: float) -> float:
    return 5.0 + 0.001 * tokens + 2.0 * pairs  # ms: 2 ms per million query-key pairs of prefill attention


def test_step_time_model_tells_the_attention_over_context_apart_from_the_tokens():
    model = StepTimeModel()
    for tokens, context in ((8, 0), (500, 0), (500, 8000), (1000, 2000), (40, 30000), (2000, 500), (300, 20000)):
        pairs = attention_pairs(tokens, context)
        model.observe(tokens, cost_with_context(tokens, pairs), pairs)
    base, per_token, per_pair = model.fit_with_pairs()
    assert (base, per_token, per_pair) == pytest.approx((5.0, 0.001, 2.0), rel=1e-6)
    for context in (0, 2000, 30000):
        got = model.tokens_for(10.0, decode_tokens=4, context=context)
        # the largest prefill that keeps the step within 10 ms at this context, to the token
        prefill = got - 4
        assert cost_with_context(4 + prefill, attention_pairs(prefill, context)) <= 10.0
        assert cost_with_context(4 + prefill + 1, attention_pairs(prefill + 1, context)) > 10.0
    assert model.tokens_for(10.0, 4, 30000) < model.tokens_for(10.0, 4, 2000) < model.tokens_for(10.0, 4, 0)


def test_a_long_prompt_takes_smaller_chunks_as_its_context_grows():
    s, _ = make(PrefillPolicy(target_step_ms=10.0), budget=4096)
    streams = decoding(s, 4)
    for tokens, context in ((4, 0), (1000, 0), (2000, 3000), (500, 6000), (300, 500)):
        pairs = attention_pairs(tokens, context)
        s.step_times.observe(tokens, cost_with_context(tokens, pairs), pairs)
    long = seq(6000)
    s.add(long)
    chunks = []
    for _ in range(40):
        if sum(chunks) == 6000:
            break
        out = step(s)
        assert all(x.num_new_tokens == 1 for x in out.scheduled if x.seq in streams)
        chunks += [x.num_new_tokens for x in out.scheduled if x.seq is long]
    assert sum(chunks) == 6000 and len(chunks) >= 4
    assert all(a > b for a, b in zip(chunks[:-2], chunks[1:-1]))  # (the last takes what is left)
    assert chunks[0] == s.step_times.tokens_for(10.0, 4, 0) - 4


def test_with_a_step_target_a_long_prompt_takes_only_what_keeps_decode_steps_near_it():
    s, _ = make(PrefillPolicy(target_step_ms=10.0), budget=4096)
    streams = decoding(s, 4)
    for tokens in (4, 1000, 2000, 500):  # what earlier steps cost: 5 ms + 0.01 ms per token
        s.observe_step(tokens, (5.0 + 0.01 * tokens) / 1e3)
    long = seq(3000)
    s.add(long)
    out = step(s)
    got = {x.seq.seq_id: x.num_new_tokens for x in out.scheduled}
    assert all(got[x.seq_id] == 1 for x in streams)
    assert sum(got.values()) == pytest.approx(500, abs=1)  # (10 - 5) / 0.01 tokens, not the 4096 budget
    assert got[long.seq_id] == sum(got.values()) - 4


def test_padded_steps_fill_the_largest_bucket_the_target_allows():
    """With mixed steps replayed at padded token counts, a step costs its whole bucket: the budget takes the
    bucket's worth (its last row but one) rather than a count between buckets, and never less than the floor."""
    s, _ = make(PrefillPolicy(target_step_ms=10.0, min_prefill_tokens=64), budget=4096)
    s.step_token_buckets = (64, 128, 256, 512, 1024)
    streams = decoding(s, 4)
    for tokens in (4, 1024, 2048, 512):
        s.observe_step(tokens, (5.0 + 0.01 * tokens) / 1e3)
    long = seq(3000)
    s.add(long)
    out = step(s)
    assert sum(x.num_new_tokens for x in out.scheduled) == 255  # 500 fit the target: the 256 bucket, less a row
    s.step_times = StepTimeModel()  # steps now cost 40 ms + 0.01 ms/token: nothing fits 10 ms
    for tokens in (256, 2048, 128):
        s.observe_step(tokens, (40.0 + 0.01 * tokens) / 1e3)
    out = step(s)
    assert all(x.num_new_tokens == 1 for x in out.scheduled if x.seq in streams)
    assert sum(x.num_new_tokens for x in out.scheduled) == 127  # the floor (4 + 64) rounded up to a bucket


BUCKETS = (64, 96, 128, 192, 256, 384, 512, 768, 1024)


def replay_ms(bucket: int, context: int) -> float:
    """A pretend card: a bucket's replay costs 4 ms + 0.01 ms a row, plus 0.5 us a row per thousand of context."""
    return 4.0 + 0.01 * bucket + 0.0005 * bucket * context / 1e3


def test_measured_bucket_times_size_every_budgeted_step_to_the_largest_bucket_within_the_target():
    """With each bucket's replay time measured at start-up, the first budgeted step keeps a margin for what a real
    step adds to a replay; once a step has run, the learned difference (the host's part, decode rows) replaces
    the margin, every step takes the largest bucket whose expected time fits, and chunks shrink as the context
    they extend grows."""
    target, host_ms = 14.0, 2.0
    s, _ = make(PrefillPolicy(target_step_ms=target, min_prefill_tokens=32), budget=4096)
    s.step_token_buckets = BUCKETS
    s.bucket_times = BucketStepTimes({b: (replay_ms(b, 0), replay_ms(b, 1000) - replay_ms(b, 0)) for b in BUCKETS})
    streams = decoding(s, 4)
    long = seq(6000)
    s.add(long)
    rows = []
    while long.num_output_tokens == 0:
        out = s.schedule()
        assert all(x.num_new_tokens == 1 for x in out.scheduled if x.seq in streams)
        tokens = sum(x.num_new_tokens for x in out.scheduled)
        bucket = min(b for b in BUCKETS if b >= tokens + 1)  # what the runner pads the step to
        context = long.num_computed_tokens
        ms = replay_ms(bucket, context) + host_ms
        s.observe_step(bucket, ms / 1e3, out)
        s.update_after_step(out, {x.seq.seq_id: 1 for x in out.scheduled if x.samples})
        rows.append((tokens, bucket, context, ms))
    first_tokens, _, _, first_ms = rows[0]
    assert first_tokens == 511 and first_ms <= target * 0.75 + host_ms  # 768's would fit 14 ms, not 10.5
    assert s.bucket_times.extra_ms == pytest.approx(host_ms)
    for tokens, bucket, context, ms in rows[1:-1]:  # (the last chunk takes what is left)
        assert tokens == bucket - 1 and ms <= target
        larger = [b for b in BUCKETS if b > bucket]
        assert not larger or replay_ms(larger[0], context) + host_ms > target
    chunks = [tokens for tokens, *_ in rows[1:-1]]
    assert chunks[0] == 767 and chunks[-1] < chunks[0] and chunks == sorted(chunks, reverse=True)


def test_bucket_times_learn_what_real_steps_add_and_ignore_steps_of_no_bucket():
    times = BucketStepTimes({64: (5.0, 0.1), 128: (8.0, 0.2)}, weight=0.5)
    assert times.tokens_for(10.0, context=0, floor=10) == 63  # the margin (2.5 ms) leaves 7.5 ms: 64 fits, 128 not
    times.observe(100, 0, 50.0)  # an eager step of 100 rows: no bucket, nothing learned
    assert times.extra_ms is None
    times.observe(128, 10_000, 11.0)  # 8 + 2 expected: 1 ms more
    times.observe(64, 0, 8.0)  # 3 ms more
    assert times.extra_ms == pytest.approx(2.0)
    assert times.tokens_for(10.0, context=0, floor=10) == 127
    assert times.tokens_for(10.0, context=20_000, floor=10) == 63  # 128's chunk over 20k: 12 + 2 ms
    assert times.tokens_for(6.0, context=0, floor=10) == 63  # nothing fits: the smallest bucket holding the floor
    assert times.tokens_for(6.0, context=0, floor=70) == 127


def test_without_decoding_sequences_the_whole_budget_goes_to_prefill():
    s, _ = make(PrefillPolicy(target_step_ms=10.0), budget=2048)
    for tokens in (4, 1000, 2000):
        s.observe_step(tokens, (5.0 + 0.01 * tokens) / 1e3)
    long = seq(3000)
    s.add(long)
    assert step(s).scheduled[0].num_new_tokens == 2048


def test_long_prefill_threshold_caps_a_long_chunk_so_a_short_prompt_arriving_meanwhile_gets_its_token():
    s, _ = make(PrefillPolicy(long_prefill_token_threshold=256), budget=512)
    long = seq(4000)
    s.add(long)
    assert step(s).scheduled[0].num_new_tokens == 512  # alone: the cap does not apply (vLLM's rule)
    short = seq(100)
    s.add(short)
    out = step(s)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(short, 100), (long, 256)]
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0


def test_a_long_prefill_fills_what_short_prompts_leave_of_a_step_budget():
    s, _ = make(PrefillPolicy(target_step_ms=10.0, long_prefill_token_threshold=1000), budget=4096)
    streams = decoding(s, 2)
    for tokens in (4, 1000, 2000, 500):  # 5 ms + 0.01 ms per token: 500 tokens a step
        s.observe_step(tokens, (5.0 + 0.01 * tokens) / 1e3)
    long = seq(3000)
    s.add(long)
    step(s)
    short = seq(200)
    s.add(short)
    got = [(x.seq, x.num_new_tokens) for x in step(s).scheduled]
    assert got == [(streams[0], 1), (streams[1], 1), (short, 200), (long, 298)]


def test_without_the_threshold_the_long_chunk_takes_the_budget_and_the_short_prompt_waits():
    s, _ = make(PrefillPolicy(), budget=512)
    long = seq(4000)
    s.add(long)
    step(s)
    short = seq(100)
    s.add(short)
    out = step(s)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(long, 512)]


def test_adaptive_threshold_never_falls_below_a_fair_share_of_the_budget():
    policy = PrefillPolicy(long_prefill_token_threshold=16, long_prefill_token_threshold_adaptive=True)
    assert policy.chunk_cap(512, 4) == 128
    assert policy.chunk_cap(512, 64) == 16
    assert policy.chunk_cap(512, 1) == 0


def test_decode_tokens_are_scheduled_before_a_higher_priority_prefill_chunk():
    s, _ = make(PrefillPolicy(), budget=64)
    low = seq(3, priority=5, max_tokens=100)
    s.add(low)
    step(s)
    urgent = seq(500, priority=-1)
    s.add(urgent)
    step(s)  # urgent starts: 63 tokens
    out = step(s)
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(low, 1), (urgent, 63)]


def test_cache_aware_admission_starts_a_warm_prompt_ahead_of_a_cold_one_once_the_cache_is_full_enough():
    s, bm = make(PrefillPolicy(cache_aware_admission_window=4, cache_aware_admission_threshold=0.0),
                 budget=64, caching=True, max_num_seqs=1)
    first = seq(16)
    s.add(first)
    while not first.is_finished:
        step(s)
    cold = seq(16, name="cold")
    cold.prompt_token_ids[:] = [9] * 16
    cold.token_ids[:] = [9] * 16
    warm = seq(16, name="warm")  # the same prompt as the finished one: its blocks are cached
    s.add(cold)
    s.add(warm)
    assert s.waiting == [cold, warm]
    out = step(s)
    assert [x.seq for x in out.scheduled] == [warm]
    assert warm.num_cached_tokens > 0


def test_cache_aware_admission_keeps_arrival_order_below_the_threshold():
    s, _ = make(PrefillPolicy(cache_aware_admission_window=4, cache_aware_admission_threshold=0.9),
                budget=64, caching=True, max_num_seqs=1)
    a, b = seq(8), seq(8)
    s.add(a)
    s.add(b)
    assert [x.seq for x in step(s).scheduled] == [a]
