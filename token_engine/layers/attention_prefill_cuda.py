"""Prefill attention that reads the paged KV pool in place (Triton, FlashAttention-style).

One launch covers every prefill sequence of a step (a ragged batch): the host cuts each sequence's new tokens
into query tiles of BLOCK_M and hands the kernel a tile list (sequence, first new token of the tile). Each
program takes one tile and one query head and walks the context through the block table, BLOCK_N keys at a
time, with an online softmax. Nothing is gathered, expanded or masked in memory:

- block-table indirection: a key's slot is `block_tables[seq, pos // block_size] * block_size + pos % block_size`;
- native GQA: a query head reads the K/V of its group's KV head; the group's programs share those reads in L2;
- causal masking by position arithmetic: new tokens are the last q_len of ctx_len positions, so a query at
  position p sees keys <= p; key tiles wholly below the tile's first query position need no mask at all;
- sliding windows: keys > p - window; tiles wholly outside every row's window are skipped.

The same kernel serves fresh prompts (ctx_len == q_len) and chunks over a cached prefix (the agent-turn case).
Runs under TRITON_INTERPRET=1 on CPU tensors too (tests/triton_kernels_check.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Tile shapes per head_dim (BLOCK_M, BLOCK_N, num_warps, num_stages); the interpreter check passes small ones.
# head_dim 128 from an H100 run of bench/experiments/prefill_attention_variants.py (128x128 tiles with 3 stages
# were the fastest for a fresh 32k prompt, an agent turn and an 8k chunk over 24k); the others tuned on an H200.
PREFILL_CONFIG = {64: (128, 64, 4, 3), 128: (128, 128, 8, 3), 256: (64, 32, 8, 2)}
# Context slices (split-K, as flash decoding) for steps with few query tiles: at most MAX_SPLITS slices, each at
# least MIN_KEYS_PER_SPLIT keys long. A slice's fixed work (loading its queries, writing and merging its partial
# result) is counted as SLICE_OVERHEAD_TILES key tiles when the slice count is chosen.
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 1024
SLICE_OVERHEAD_TILES = 2
# Streaming multiprocessors assumed where no CUDA device answers (the interpreter's checks): an H100's or H200's.
DEFAULT_SMS = 132


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q, n_lo, n_hi, ctx_len, window, qk_scale,
    stride_cb, stride_ct,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    for n in range(n_lo, n_hi, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        if MASKED:
            in_ctx = pos < ctx_len
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        # K and V both as [BLOCK_N, HEAD_DIM] rows of the pool; K is transposed in the product (on an H100 this
        # ran 4-6% faster than loading K as [HEAD_DIM, BLOCK_N]: bench/experiments/prefill_attention_variants.py)
        off = (block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_off)[:, None] + d[None, :]
        if MASKED:
            k = tl.load(k_cache_ptr + off, mask=in_ctx[:, None], other=0.0)
            v = tl.load(v_cache_ptr + off, mask=in_ctx[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + off)
            v = tl.load(v_cache_ptr + off)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = s * qk_scale
            seen = (pos[None, :] <= pos_q[:, None]) & in_ctx[None, :]
            if WINDOW:
                seen &= pos[None, :] > pos_q[:, None] - window
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp2(s - m_use[:, None])
        else:  # the scale goes into the maximum's subtraction: one multiply-add per score (the scale is > 0)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


# Integers that change from step to step are not specialized on (each specialization is a compile).
@triton.jit(do_not_specialize=["window", "stride_bt", "num_splits"])
def _prefill_paged_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, q_start_ptr, tile_seq_ptr,
    tile_m_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    ctx_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_begin
    first_pos = ctx_len - q_len  # position of the sequence's first new token

    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    pos_q = first_pos + m
    rows = (q_begin + m).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_mask[:, None], other=0.0)

    kv_off = (head // GROUP) * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    lo_pos = first_pos + m0  # the tile's first query position
    hi = tl.minimum(ctx_len, first_pos + tl.minimum(m0 + BLOCK_M, q_len))  # past the last key any row sees
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WINDOW:
        start = tl.maximum(0, lo_pos - window + 1) // BLOCK_N * BLOCK_N
        full = start  # every key tile of a window is masked
    else:
        start = 0
        full = (lo_pos + 1) // BLOCK_N * BLOCK_N  # keys below this are visible to every row of the tile
    if SPLIT:  # this program takes one slice of the key tiles [start, hi); the merge kernel combines the slices
        per_split = tl.cdiv(tl.cdiv(hi - start, BLOCK_N), num_splits) * BLOCK_N
        lo_s = start + split * per_split
        hi_s = tl.minimum(hi, lo_s + per_split)
    else:
        lo_s = start
        hi_s = hi
    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q, lo_s,
                                 tl.minimum(full, hi_s), ctx_len, window, qk_scale, stride_cb, stride_ct,
                                 BLOCK_SIZE, BLOCK_N, False, WINDOW, IEEE)
    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q,
                                 tl.maximum(full, lo_s), hi_s, ctx_len, window, qk_scale, stride_cb, stride_ct,
                                 BLOCK_SIZE, BLOCK_N, True, WINDOW, IEEE)
    if SPLIT:
        part = ((tile * NUM_HEADS + head) * num_splits + split) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(part_m_ptr + part, m_i)
        tl.store(part_l_ptr + part, l_i)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded rows of a windowed tile may see nothing
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _prefill_merge_kernel(
    out_ptr, q_start_ptr, tile_seq_ptr, tile_m_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Combines the context slices of one (query tile, head): softmax states in base 2, as the kernel keeps them."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    q_begin = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_begin
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    base = (tile * NUM_HEADS + head) * num_splits
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + (base + s) * BLOCK_M + tl.arange(0, BLOCK_M)))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for s in range(0, num_splits):
        part = (base + s) * BLOCK_M + tl.arange(0, BLOCK_M)
        w = tl.exp2(tl.load(part_m_ptr + part) - m_use)
        l_sum += w * tl.load(part_l_ptr + part)
        acc += w[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :])
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    rows = (q_begin + m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m < q_len)[:, None])


def prefill_tiles(prefill: list[tuple[int, int]], block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first new token of the tile) for each query tile; prefill holds (sequence, q_len) pairs.
    The longest rows go first: their programs run longest, so the grid's tail stays short."""
    tiles = [(s, m) for s, q_len in prefill for m in range(0, q_len, block_m)]
    tiles.sort(key=lambda t: -t[1])
    return [s for s, _ in tiles], [m for _, m in tiles]


@functools.lru_cache(maxsize=1024)  # asked per layer of every eager prefill step: the shapes repeat
def prefill_splits(num_tiles: int, num_heads: int, max_context: int, block_n: int, slots: int | None = None) -> int:
    """Context slices per (query tile, head): a short chunk over a long cached prefix has few tiles, and one
    program per tile would walk the whole context alone while most SMs idle. Depends on shapes only (a CUDA
    graph's grid is fixed).

    The programs of such a step all walk about as many keys, so they run in waves of `slots` (the programs
    the card holds at once): the count chosen is the one whose waves, times the key tiles each slice walks plus
    its fixed work, are least. (Asking only for enough programs to fill the card could land just past a whole
    wave: 2 query tiles x 28 heads x 5 slices is 280 programs, three waves of 132 for the work of 2.1.)"""
    programs = num_tiles * num_heads
    slots = slots or _sm_count()  # one program per SM: a tile set takes most of an SM's shared memory
    if programs >= 2 * slots:
        return 1  # enough programs to balance the card; causal tiles of a fresh prompt differ in length anyway
    key_tiles = max(1, -(-max_context // block_n))
    most = max(1, min(MAX_SPLITS, max_context // MIN_KEYS_PER_SPLIT))

    def cost(splits: int) -> int:
        return -(-programs * splits // slots) * (-(-key_tiles // splits) + SLICE_OVERHEAD_TILES)

    return min(range(1, most + 1), key=lambda splits: (cost(splits), splits))


def _sm_count() -> int:
    properties = _device_properties()
    return DEFAULT_SMS if properties is None else properties.multi_processor_count


def prefill_config(head_dim: int, element_bytes: int = 2) -> tuple[int, int, int, int]:
    """The table's tile shape, or where this card's shared memory per block cannot hold its tiles (an A100 has 163
    KiB against Hopper's 227; 32-bit inputs need twice the room), the first smaller one that fits: shorter key
    tiles, then fewer pipeline stages. The query tile stays: the host plans the step's tiles by it."""
    return _fitting(PREFILL_CONFIG.get(head_dim, (64, 32, 4, 2)), head_dim, element_bytes, _shared_memory_per_block())


@functools.cache
def _fitting(config: tuple[int, int, int, int], head_dim: int, element_bytes: int, limit: int | None
             ) -> tuple[int, int, int, int]:
    # (asked per layer of every prefill step: the answer is kept per table shape, head size and card)
    if limit is None:
        return config
    block_m, block_n, warps, stages = config
    candidates = [(block_m, block_n, warps, stages), (block_m, block_n // 2, warps, stages),
                  (block_m, block_n // 2, warps, 2), (block_m, 32, 4, 2), (block_m, 16, 4, 1)]
    fits = (c for c in candidates if c[1] >= 16 and tile_bytes(c, head_dim, element_bytes) <= limit)
    return next(fits, candidates[-1])


def tile_bytes(config: tuple[int, int, int, int], head_dim: int, element_bytes: int = 2) -> int:
    """Shared memory a config's tiles take, at ``element_bytes`` an element: Q's, and K's and V's in every
    pipeline stage."""
    block_m, block_n, _, stages = config
    return (block_m + 2 * stages * block_n) * head_dim * element_bytes


def _shared_memory_per_block() -> int | None:
    """The most shared memory a block of this process's CUDA device may ask for (None: no CUDA device)."""
    properties = _device_properties()
    return None if properties is None else getattr(properties, "shared_memory_per_block_optin", None)


@functools.cache
def _device_properties() -> Any:
    """This process's CUDA device's properties (None: no CUDA device)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device())


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    tile_seq: torch.Tensor,
    tile_m: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Writes out[rows of the tiles' sequences] for the query tiles listed in tile_seq/tile_m (int32, device)."""
    num_tiles = int(tile_seq.shape[0])
    if num_tiles == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    block_m, block_n, warps, stages = config or prefill_config(head_dim, q.element_size())
    if q.stride(-1) != 1:
        q = q.contiguous()
    splits = prefill_splits(num_tiles, num_heads, meta.max_seq_len, block_n) if num_splits is None else num_splits
    if splits > 1:
        part_m = torch.empty(num_tiles * num_heads * splits * block_m, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(part_m.shape[0], head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused: the kernel writes out directly
    _prefill_paged_kernel[(num_tiles, num_heads, splits)](
        q, out, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tile_seq, tile_m,
        part_m, part_l, part_acc, scale * LOG2E, sliding_window or 0, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=meta.block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT=splits > 1, WINDOW=bool(sliding_window), IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _prefill_merge_kernel[(num_tiles, num_heads)](
            out, meta.query_start_loc, tile_seq, tile_m, part_m, part_l, part_acc, splits,
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_M=block_m,
        )
    return out
