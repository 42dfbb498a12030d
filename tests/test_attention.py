"""Paged attention against dense causal attention on the same K/V, with shuffled, non-contiguous block tables."""

import random

import pytest
import torch

from token_engine.layers.attention import allocate_kv_pool, build_metadata, paged_attention, store_kv

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 16, 3

# Tiny tensors on a shared 2-core machine: extra intra-op threads only spin (25x slower under load).
torch.set_num_threads(1)


def dense_causal(q, k, v, scale, sliding_window=None):
    """q: [n, H, D] at the last n positions of k/v: [L, Hkv, D]; reference attention, no paging."""
    n, length = q.shape[0], k.shape[0]
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def random_tables(rng, seq_lens, block_size, num_blocks):
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for length in seq_lens:
        need = -(-length // block_size)
        tables.append([free.pop() for _ in range(need)])
    return tables


def run_step(pool, layer, tables, cached, new, block_size, scale, sliding_window=None, gen=None):
    """Writes new K/V for each sequence and attends; returns (out, q, full k, full v per sequence)."""
    seq_lens = [c + n for c, n in zip(cached, new)]
    meta = build_metadata(new, seq_lens, tables, block_size)
    total = sum(new)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, DIM, generator=gen)
    store_kv(k, v, pool, layer, meta)
    return paged_attention(q, pool, layer, meta, scale, sliding_window), q, k, v


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_and_decode_batch_matches_dense_attention(block_size):
    rng = random.Random(block_size)
    gen = torch.Generator().manual_seed(block_size)
    pool = allocate_kv_pool(64 * 16 // block_size, LAYERS, block_size, KV_HEADS, DIM, torch.float32)
    layer, scale = 1, DIM**-0.5
    # sequence 0: 9 cached + 1 new (decode); 1: fresh prefill of 13; 2: 5 cached + 7 new (chunked prefill)
    cached, new = [9, 0, 5], [1, 13, 7]
    tables = random_tables(rng, [c + n for c, n in zip(cached, new)], block_size, pool.shape[0])
    history = []
    for s, c in enumerate(cached):  # fill the cached part of each sequence first
        k = torch.randn(c, KV_HEADS, DIM, generator=gen)
        v = torch.randn(c, KV_HEADS, DIM, generator=gen)
        if c:
            store_kv(k, v, pool, layer, build_metadata([c], [c], [tables[s]], block_size))
        history.append((k, v))
    out, q, k_new, v_new = run_step(pool, layer, tables, cached, new, block_size, scale, gen=gen)
    start = 0
    for s in range(3):
        end = start + new[s]
        k_all = torch.cat([history[s][0], k_new[start:end]])
        v_all = torch.cat([history[s][1], v_new[start:end]])
        expected = dense_causal(q[start:end], k_all, v_all, scale)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
        start = end


def test_store_kv_writes_only_its_own_layer_and_slots():
    block_size = 4
    pool = allocate_kv_pool(8, LAYERS, block_size, KV_HEADS, DIM, torch.float32)
    meta = build_metadata([6], [6], [[5, 0]], block_size)
    k = torch.ones(6, KV_HEADS, DIM)
    v = torch.full((6, KV_HEADS, DIM), 2.0)
    store_kv(k, v, pool, 2, meta)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 23, 0, 1]
    assert torch.all(pool[5, 2, 0] == 1) and torch.all(pool[5, 2, 1] == 2)
    assert torch.all(pool[0, 2, 0, :2] == 1) and torch.all(pool[0, 2, 0, 2:] == 0)
    assert pool[:, :2].abs().sum() == 0  # other layers untouched
    assert pool[[1, 2, 3, 4, 6, 7]].abs().sum() == 0


def test_negative_slots_are_not_written():
    pool = allocate_kv_pool(4, 1, 2, KV_HEADS, DIM, torch.float32)
    meta = build_metadata([2], [2], [[3]], 2)
    meta.slot_mapping = torch.tensor([6, -1])
    store_kv(torch.ones(2, KV_HEADS, DIM), torch.ones(2, KV_HEADS, DIM), pool, 0, meta)
    assert pool[3, 0, :, 0].abs().sum() > 0
    assert pool[3, 0, :, 1].abs().sum() == 0
    assert pool[:3].abs().sum() == 0


def test_kv_pool_block_is_one_contiguous_region_across_layers():
    pool = allocate_kv_pool(6, LAYERS, 4, KV_HEADS, DIM, torch.bfloat16)
    block = pool[3]
    assert block.is_contiguous()
    assert block.data_ptr() == pool.data_ptr() + 3 * block.numel() * pool.element_size()
    assert pool[:, 1, 0].shape == (6, 4, KV_HEADS, DIM)


def test_sliding_window_limits_what_a_query_sees():
    gen = torch.Generator().manual_seed(7)
    block_size, window = 4, 5
    pool = allocate_kv_pool(16, 1, block_size, KV_HEADS, DIM, torch.float32)
    tables = [[9, 2, 14, 0, 5]]
    out, q, k, v = run_step(pool, 0, tables, [0], [19], block_size, DIM**-0.5, sliding_window=window, gen=gen)
    expected = dense_causal(q, k, v, DIM**-0.5, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    full = dense_causal(q, k, v, DIM**-0.5)
    assert not torch.allclose(out[-1], full[-1], atol=1e-3)


def test_decode_reads_cached_blocks_written_by_earlier_steps():
    gen = torch.Generator().manual_seed(3)
    block_size = 2
    pool = allocate_kv_pool(32, 2, block_size, KV_HEADS, DIM, torch.float32)
    tables = [[17, 4, 30, 8, 1, 22], [3, 0, 12, 25, 9, 6]]
    ks, vs = [[], []], [[], []]
    lengths = [0, 0]
    for step_new in ([3, 5], [1, 1], [1, 1], [2, 1], [1, 3]):
        out, q, k, v = run_step(pool, 1, tables, lengths, step_new, block_size, 0.3, gen=gen)
        start = 0
        for s in range(2):
            end = start + step_new[s]
            ks[s].append(k[start:end])
            vs[s].append(v[start:end])
            expected = dense_causal(q[start:end], torch.cat(ks[s]), torch.cat(vs[s]), 0.3)
            torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
            start = end
        lengths = [a + b for a, b in zip(lengths, step_new)]


def test_build_metadata_rejects_a_block_table_too_short():
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([5], [9], [[1, 2]], 4)


def test_build_metadata_slots_and_padded_tables_follow_the_block_tables():
    rng = random.Random(3)
    block_size = 4
    query_lens, seq_lens, tables = [], [], []
    for _ in range(6):  # decodes, chunks over cached prefixes crossing blocks, a fresh prompt, one long table
        seq_len = rng.choice([1, 5, 9, 16, 37, 130])
        query_lens.append(rng.choice([1, seq_len, max(1, seq_len // 3)]))
        seq_lens.append(seq_len)
        tables.append(rng.sample(range(200), -(-seq_len // block_size) + rng.choice([0, 2])))
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    slots = [t[p // block_size] * block_size + p % block_size
             for q, n, t in zip(query_lens, seq_lens, tables) for p in range(n - q, n)]
    assert meta.slot_mapping.tolist() == slots
    width = max(len(t) for t in tables)
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]


def test_bf16_pool_matches_dense_attention_loosely():
    gen = torch.Generator().manual_seed(11)
    pool = allocate_kv_pool(16, 1, 4, KV_HEADS, DIM, torch.bfloat16)
    meta = build_metadata([10], [10], [[6, 1, 12]], 4)
    q = torch.randn(10, HEADS, DIM, generator=gen).bfloat16()
    k = torch.randn(10, KV_HEADS, DIM, generator=gen).bfloat16()
    v = torch.randn(10, KV_HEADS, DIM, generator=gen).bfloat16()
    store_kv(k, v, pool, 0, meta)
    out = paged_attention(q, pool, 0, meta, DIM**-0.5)
    expected = dense_causal(q.float(), k.float(), v.float(), DIM**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# The CUDA backend's Triton kernels: under Triton's interpreter on CPU where triton is installed, and for real on
# a GPU (tests marked gpu).


@pytest.mark.slow
def test_triton_kernels_match_the_reference_under_the_interpreter():
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    script = Path(__file__).with_name("triton_kernels_check.py")
    # the checkout's packages importable in the child also where they are not installed (a bare GPU machine)
    path = os.pathsep.join(p for p in (str(script.parents[1]), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all kernels ok" in result.stdout


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_case(block_size, dtype, heads, kv_heads, dim, cached, new, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    pool = torch.randn(num_blocks, 2, 2, block_size, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    tables = random_tables(rng, lens, block_size, num_blocks)
    meta = build_metadata(new, lens, tables, block_size, device="cuda")
    total = sum(new)
    q = torch.randn(total, heads, dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    return pool, meta, q, k, v


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_store_and_attention_match_the_reference(dtype, block_size):
    from token_engine.layers import attention_cuda
    from token_engine.layers.attention import _paged_attention_reference

    # Qwen2.5-7B's head shape: 28 query heads over 4 KV heads (groups of 7), head_dim 128
    cached, new = [0, 900, 33, 2000, 5, 0, 1], [700, 1, 64, 1, 1, 1, 3]
    pool, meta, q, k, v = _gpu_case(block_size, dtype, 28, 4, 128, cached, new, seed=block_size)
    reference_pool = pool.clone()
    # the reference stores with plain indexing (the CPU path's code, run on CUDA tensors)
    bs = block_size
    reference_pool[meta.slot_mapping // bs, 1, 0, meta.slot_mapping % bs] = k
    reference_pool[meta.slot_mapping // bs, 1, 1, meta.slot_mapping % bs] = v
    attention_cuda.store_kv(k, v, pool, 1, meta)
    assert torch.equal(pool, reference_pool)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    ref = _paged_attention_reference(q.float(), pool.float(), 1, meta, 128**-0.5, None)
    out = attention_cuda.paged_attention(q, pool, 1, meta, 128**-0.5, None, k, v)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    decode = build_metadata([1] * 7, meta.host_lists()[1], meta.block_tables.tolist(), bs, device="cuda")
    qd = q[:7].contiguous()
    for window in (None, 100):
        ref = _paged_attention_reference(qd.float(), pool.float(), 1, decode, 128**-0.5, window)
        out = attention_cuda.paged_attention(qd, pool, 1, decode, 128**-0.5, window)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
def test_cuda_fused_layers_match_torch_in_bf16():
    from token_engine.layers import blocks_cuda
    from token_engine.layers.blocks import RMSNorm, apply_rotary

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(37, 3584, generator=gen, device="cuda").bfloat16() for _ in range(2))
    norm = RMSNorm(3584, 1e-6, dtype=torch.bfloat16).cuda()
    norm.weight.data.normal_(1.0, 0.1, generator=gen)
    want, want_res = norm._norm(x + r), x + r
    got, got_res = blocks_cuda.rms_norm(x, norm.weight, 1e-6, r)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    qkv = torch.randn(37, (28 + 8) * 128, generator=gen, device="cuda").bfloat16()
    q, k = qkv[:, : 28 * 128].view(37, 28, 128), qkv[:, 28 * 128 : 32 * 128].view(37, 4, 128)
    angles = torch.randn(37, 64, generator=gen, device="cuda") * 100
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    q_out, k_out = blocks_cuda.qk_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_out, apply_rotary(q, cos, sin), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, apply_rotary(k, cos, sin), atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(37, 2 * 18944, generator=gen, device="cuda").bfloat16()
    want = torch.nn.functional.silu(gate_up[:, :18944]) * gate_up[:, 18944:]
    torch.testing.assert_close(blocks_cuda.silu_and_mul(gate_up), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 300])
def test_cuda_paged_prefill_over_cached_prefixes_matches_the_reference(window):
    """Prefill chunks over cached prefixes of many lengths (block boundaries inside and at the edge of a key
    tile), fresh prompts and decodes in one step, bf16, Qwen2.5-7B's head shape."""
    from token_engine.layers import attention_cuda
    from token_engine.layers.attention import _paged_attention_reference

    cached, new = [0, 2047, 16, 5000, 700, 0, 129], [1000, 300, 1, 1600, 2, 77, 1]
    pool, meta, q, k, v = _gpu_case(16, torch.bfloat16, 28, 4, 128, cached, new, seed=11)
    attention_cuda.store_kv(k, v, pool, 1, meta)
    ref = _paged_attention_reference(q.float(), pool.float(), 1, meta, 128**-0.5, window)
    out = attention_cuda.paged_attention(q, pool, 1, meta, 128**-0.5, window, k, v)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_cuda_fresh_prompt_through_cudnn_padded_to_a_bucket_matches_the_reference(monkeypatch):
    from token_engine.layers import attention_cuda
    from token_engine.layers.attention import _paged_attention_reference

    monkeypatch.setattr(attention_cuda, "FRESH_PREFILL_CUDNN_MIN", 256)
    monkeypatch.setattr(attention_cuda, "CUDNN_BUCKET", 256)
    cached, new = [0, 40, 0], [300, 7, 100]  # 300 pads to 512; 100 stays on the paged kernel
    pool, meta, q, k, v = _gpu_case(16, torch.bfloat16, 28, 4, 128, cached, new, seed=5)
    attention_cuda.store_kv(k, v, pool, 1, meta)
    ref = _paged_attention_reference(q.float(), pool.float(), 1, meta, 128**-0.5, None)
    out = attention_cuda.paged_attention(q, pool, 1, meta, 128**-0.5, None, k, v)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("limit, element_bytes, expected", [
    (232448, 2, (128, 128, 8, 3)),  # Hopper: 227 KiB a block
    (232448, 4, (128, 64, 8, 2)),  # 32-bit inputs
    (166912, 2, (128, 64, 8, 3)),  # an A100: 163 KiB
    (101376, 2, (128, 64, 8, 2)),  # 99 KiB
    (None, 2, (128, 128, 8, 3)),  # no CUDA device: the table's shape (the interpreter passes its own)
])
def test_prefill_tiles_shrink_to_the_cards_shared_memory(monkeypatch, limit, element_bytes, expected):
    pytest.importorskip("triton")
    from token_engine.layers import attention_prefill_cuda as apc

    monkeypatch.setattr(apc, "_shared_memory_per_block", lambda: limit)
    config = apc.prefill_config(128, element_bytes)
    assert config == expected
    assert limit is None or apc.tile_bytes(config, 128, element_bytes) <= limit


@pytest.mark.parametrize("tiles, context, expected", [
    (2, 33280, 7),  # 392 programs: three waves of 132 nearly full (5 slices, 280 programs, left the third empty)
    (1, 33280, 9),
    (4, 33280, 7),
    (2, 1024, 1),  # too short to slice: one slice is at least MIN_KEYS_PER_SPLIT keys
    (10, 33280, 1),  # 280 programs already: more than two waves to balance
])
def test_prefill_context_slices_fill_whole_waves(tiles, context, expected):
    pytest.importorskip("triton")
    from token_engine.layers import attention_prefill_cuda as apc

    splits = apc.prefill_splits(tiles, 28, context, 128, slots=132)
    assert splits == expected
    assert splits <= apc.MAX_SPLITS and (splits == 1 or context // splits >= apc.MIN_KEYS_PER_SPLIT)
