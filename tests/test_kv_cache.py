"""BlockManager: allocation, reference counts, prefix caching by chained block hash, eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from token_engine.core.kv_cache import BlockManager, hash_block
from token_engine.core.sequence import SamplingOptions, Sequence


def seq(tokens, salt=None, name="s") -> Sequence:
    return Sequence(seq_id=name, request_id=name, index=0, prompt_token_ids=list(tokens), options=SamplingOptions(),
                    cache_salt=salt)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What a step does for s: room for every token, all computed, full blocks published."""
    assert bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    hits = bm.find_cached_prefix(s)
    assert bm.can_admit(s, hits, s.num_tokens - len(hits) * bm.block_size)
    bm.take_cached_blocks(s, hits)
    return hits


def test_allocation_covers_the_tokens_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks() == 5
    assert bm.allocate(s, 0) and len(s.block_table) == 3
    bm.free_blocks(s)
    assert bm.num_free_blocks() == 8 and s.block_table == []


def test_allocation_fails_without_partial_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks() == 2


def test_identical_prefix_hits_full_blocks_but_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12), name="a")
    compute_all(bm, a)
    b = seq(range(12), name="b")  # exactly three blocks: the last one must not hit (its token gives logits)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2


def test_prefix_hit_needs_the_whole_prefix_not_just_the_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], name="a"))
    # Second block identical, first block different: the chained hash must not hit.
    assert bm.find_cached_prefix(seq([0, 0, 0, 0, 5, 6, 7, 8, 9], name="b")) == []


def test_cache_salt_separates_identical_prompts():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute_all(bm, seq(range(9), salt="x", name="a"))
    assert bm.find_cached_prefix(seq(range(9), salt="y", name="b")) == []
    assert bm.find_cached_prefix(seq(range(9), name="c")) == []
    assert len(bm.find_cached_prefix(seq(range(9), salt="x", name="d"))) == 2
    assert hash_block(None, [1, 2], "x") != hash_block(None, [1, 2], None)


def test_freed_cached_blocks_count_as_free_and_can_still_be_hit():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(9), name="a")
    compute_all(bm, a)
    cached_ids = a.block_table[:2]
    bm.free_blocks(a)
    assert bm.num_free_blocks() == 6
    b = seq(range(9), name="b")
    assert admit(bm, b) == cached_ids
    assert bm.num_free_blocks() == 4


def test_allocation_evicts_uncached_blocks_before_cached_ones_and_forgets_evicted_hashes():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9), name="a")  # 2 full cached blocks + 1 partial
    compute_all(bm, a)
    bm.free_blocks(a)
    filler = seq(range(100, 104), name="f")
    assert bm.allocate(filler, 4)  # takes a never-cached block first
    assert len(bm.find_cached_prefix(seq(range(9), name="b"))) == 2
    assert bm.allocate(filler, 12)  # 3 blocks: the last never-cached one, then a cached one
    assert len(bm.find_cached_prefix(seq(range(9), name="c"))) == 1  # the tail block went first


def test_can_admit_counts_hit_blocks_that_sit_on_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(range(9), name="a")
    compute_all(bm, a)
    bm.free_blocks(a)
    b = seq(list(range(8)) + [50, 51, 52, 53, 54], name="b")  # hits 2 blocks, needs 3 more tokens' blocks
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    # 2 hit blocks come off the free list, leaving 1 for the remaining 5 tokens (2 blocks): no room.
    assert not bm.can_admit(b, hits, 5)
    assert bm.can_admit(b, hits, 4)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute_all(bm, seq(range(9), name="a"))
    assert bm.find_cached_prefix(seq(range(9), name="b")) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14), st.booleans()), min_size=1, max_size=30))
def test_block_accounting_returns_to_idle_after_any_sequence_of_operations(ops):
    """Random admit/extend/free traffic over a handful of shared prefixes never leaks or double-frees."""
    bm = BlockManager(num_blocks=12, block_size=4)
    live: list[Sequence] = []
    for i, (prefix, length, release) in enumerate(ops):
        s = seq([prefix] * length, name=f"s{i}")
        hits = bm.find_cached_prefix(s)
        if bm.can_admit(s, hits, s.num_tokens - len(hits) * 4):
            bm.take_cached_blocks(s, hits)
            compute_all(bm, s)
            live.append(s)
        if release and live:
            bm.free_blocks(live.pop(0))
        assert 0 <= bm.num_free_blocks() <= 12
        assert all(rc >= 0 for rc in bm.ref_counts)
    for s in live:
        bm.free_blocks(s)
    assert bm.num_free_blocks() == 12
    assert all(rc == 0 for rc in bm.ref_counts)
