"""The synchronous engine core on a tiny random Qwen3: scheduling choices never change greedy output."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine_harness import greedy_reference, make_engine, tiny_loaded_model
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(10, 10 + n)) for n in (5, 23, 14, 31)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from tiny_loaded_model(tmp_path_factory)



def run(engine: LLMEngine, prompts, options=GREEDY) -> list[list[int]]:
    outputs = engine.generate(prompts, options)
    assert engine.num_free_blocks() == engine.num_blocks  # block accounting returns to idle
    return outputs


@pytest.fixture(scope="module")
def reference(model):
    return [greedy_reference(model[1], p, GREEDY.max_tokens) for p in PROMPTS]


def test_batched_greedy_equals_one_at_a_time_greedy(model, reference):
    assert run(make_engine(model), PROMPTS) == reference


def test_chunked_prefill_output_equals_unchunked(model, reference):
    # every prompt but the first is split into chunks
    engine = make_engine(model, max_num_batched_tokens=7, max_num_seqs=4)
    assert run(engine, PROMPTS) == reference


def test_preemption_output_equals_no_preemption(model, reference):
    # 20 blocks of 4 tokens hold one 41-token sequence (11 blocks) but not all four sequences at once.
    engine = make_engine(model, num_gpu_blocks_override=20, max_model_len=64)
    assert run(engine, PROMPTS) == reference
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hit_gives_the_same_output_and_counts_hit_tokens(model, reference):
    engine = make_engine(model)
    prompt = PROMPTS[3]  # 31 tokens: 7 full blocks of 4
    assert run(engine, [prompt]) == [reference[3]]
    assert engine.block_manager.prefix_hits == 0
    assert run(engine, [prompt]) == [reference[3]]
    assert engine.block_manager.prefix_hits == 28
    assert engine.block_manager.prefix_queries == 62


def test_prefix_cache_is_isolated_by_cache_salt(model):
    engine = make_engine(model)
    prompt = PROMPTS[3]
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_work():
        engine.step()
    engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    while engine.has_work():
        engine.step()
    assert engine.block_manager.prefix_hits == 0
    engine.add_request("c", prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_work():
        engine.step()
    assert engine.block_manager.prefix_hits == 28


def test_lower_priority_value_runs_first(model):
    engine = make_engine(model, max_num_seqs=1)
    finished = []
    opts = dataclasses.replace(GREEDY, max_tokens=2)
    for rid, priority in (("late", 5), ("urgent", -1), ("normal", 0)):
        engine.add_request(rid, [1, 2, 3], opts, priority=priority,
                           on_update=lambda u: finished.append(u.request_id) if u.finished else None)
    while engine.has_work():
        engine.step()
    assert finished == ["urgent", "normal", "late"]


def test_abort_mid_generation_frees_blocks_and_reports_abort(model):
    engine = make_engine(model)
    updates = []
    engine.add_request("r", PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=50), on_update=updates.append)
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks() < engine.num_blocks
    engine.abort_request("r")
    assert engine.num_free_blocks() == engine.num_blocks
    assert updates[-1].finished and updates[-1].deltas[0].finish_reason == "abort"
    assert not engine.has_work()


def test_n_children_share_the_prompt_but_sample_independently(model):
    engine = make_engine(model)
    got = []
    opts = SamplingOptions(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("n", PROMPTS[1], opts, n=3, on_update=got.append)
    while engine.has_work():
        engine.step()
    per_index: dict[int, list[int]] = {}
    for update in got:
        for d in update.deltas:
            per_index.setdefault(d.index, []).extend(d.token_ids)
    assert sorted(per_index) == [0, 1, 2] and all(len(v) == 6 for v in per_index.values())
    assert len({tuple(v) for v in per_index.values()}) > 1  # seeds seed, seed+1, seed+2 differ
    assert engine.num_free_blocks() == engine.num_blocks


def test_min_tokens_holds_back_eos_and_stop_ids(model, reference):
    engine = make_engine(model)
    stop = reference[0][1]  # the greedy second token
    opts = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=frozenset({stop}), min_tokens=0)
    assert run(engine, [PROMPTS[0]], opts)[0][-1] == stop
    opts = dataclasses.replace(opts, min_tokens=4)
    out = run(engine, [PROMPTS[0]], opts)[0]
    assert stop not in out[:4] and len(out) >= 4


def test_seeded_request_is_reproducible_whatever_shares_its_batch(model):
    opts = SamplingOptions(temperature=0.8, top_k=40, seed=1234, max_tokens=8, ignore_eos=True)
    alone = run(make_engine(model), [PROMPTS[0]], opts)[0]
    engine = make_engine(model)
    noisy = SamplingOptions(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs: dict[str, list[int]] = {"seeded": [], "other": []}
    engine.add_request("other", PROMPTS[2], noisy, on_update=lambda u: outs["other"].extend(u.deltas[0].token_ids))
    engine.add_request("seeded", PROMPTS[0], opts, on_update=lambda u: outs["seeded"].extend(u.deltas[0].token_ids))
    while engine.has_work():
        engine.step()
    assert outs["seeded"] == alone


def test_generation_stops_at_max_model_len(model):
    engine = make_engine(model, max_model_len=32)
    out = run(engine, [PROMPTS[3]], dataclasses.replace(GREEDY, max_tokens=100))[0]
    assert len(PROMPTS[3]) + len(out) == 32


def test_a_token_budget_below_max_num_seqs_is_refused(model):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(model, max_num_batched_tokens=8, max_num_seqs=16)


def test_kv_cache_smaller_than_one_context_is_refused(model):
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(model, num_gpu_blocks_override=4, max_model_len=64)
