"""CUDA backend of token_engine.attention: same contract, faster.

- store_kv: one Triton program per new token copies its K and V rows into the pool; slots < 0 are skipped
  (the padded rows of a CUDA-graph decode batch).
- decode (every sequence has one new token): a split-K ("flash decoding") Triton kernel. Each program takes
  one sequence, one KV head (all the query heads that share it, so K/V are read once per group) and one slice
  of the context, gathering tokens through the block table; a second kernel merges the slices' partial
  softmax states. No host syncs and no data-dependent launch shapes, so it is capturable in a CUDA graph.
  The number of slices is a runtime argument (only the merge's padded width is compiled in): were it a
  compile-time constant, every new count of decoding sequences in a mixed step would compile a kernel
  (0.6-3 s on an H200, measured by bench/gpu_decode_profile.py) while requests wait.
- prefill (some sequence has several new tokens): per sequence, torch's scaled_dot_product_attention; a fresh
  prompt uses the step's own K/V with is_causal (FlashAttention), a chunk over cached context gathers its
  context from the pool and uses a bottom-right causal mask. Sequences of the step with a single new token
  go through the decode kernel.

Importing this module needs triton; token_engine.attention imports it only for CUDA tensors. With
TRITON_INTERPRET=1 the kernels also run on CPU tensors (that is how the CPU test suite checks them when triton
is installed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Decode: tokens per inner iteration, and a target of programs in flight (H200: 132 SMs).
DECODE_BLOCK_N = 64
TARGET_PROGRAMS = 2 * 132
MAX_SPLITS = 32
# Prefill attention backends, cuDNN left out: it builds an execution plan for every new shape, and a chunk's
# length and context change from step to step under load, so steps took 0.1-2.5 s instead of ~50 ms on an
# H200 (bench/gpu_decode_profile.py, mixed_step). Flash and memory-efficient kernels need no plan.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    idx = tl.arange(0, HD_PAD)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    mask = (idx < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_ct + head * stride_ch + dim
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Triton specializes integer arguments on their value (== 1, divisible by 16): these vary from step to step
# (block-table width, slices), and each specialization would be one more compile while requests wait.
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "window"])
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, q_start_ptr, seq_ids_ptr,
    m_ptr, l_ptr, acc_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch,
    stride_bt, num_splits,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, IEEE: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(q_start_ptr + seq).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)

    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(seq_len, start + per_split * BLOCK_N)
    if window > 0:  # the query (position seq_len - 1) sees keys at positions >= seq_len - window
        start = tl.maximum(start, seq_len - window)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(start, end, BLOCK_N):
        pos = t + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = tl.where(p_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    part = (i * NUM_HEADS + heads) * num_splits + split
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, q_start_ptr, seq_ids_ptr,
    stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_SEQ_IDS: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    row = tl.load(q_start_ptr + seq).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    d = tl.arange(0, HEAD_DIM)
    base = (i * NUM_HEADS + head) * num_splits
    m = tl.load(m_ptr + base + s, mask=s_mask, other=float("-inf"))
    denom = tl.load(l_ptr + base + s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    acc = tl.load(acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _cache_views(kv_pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = kv_pool[:, layer, 0], kv_pool[:, layer, 1]
    assert k_cache.stride(-1) == 1, "kv_pool must be contiguous in head_dim"
    return k_cache, v_cache


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: int, meta) -> None:
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    k_cache, v_cache = _cache_views(kv_pool, layer)
    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, meta.slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=heads, HEAD_DIM=dim, HD_PAD=triton.next_power_of_2(heads * dim), BLOCK_SIZE=meta.block_size,
    )


def splits_pad(splits: int) -> int:
    """The merge kernel's compile-time width: a power of two, so a handful of variants cover every batch."""
    return max(2, triton.next_power_of_2(splits))


def decode_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Context slices per (sequence, KV head): enough programs to fill the GPU; depends on shapes only."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))))


def decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta,
    scale: float,
    sliding_window: int | None = None,
    seq_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for sequences with exactly one new token (all of them, or those listed in seq_ids)."""
    k_cache, v_cache = _cache_views(kv_pool, layer)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num = int(seq_ids.shape[0]) if seq_ids is not None else int(meta.seq_lens.shape[0])
    if out is None:
        out = torch.empty_like(q)
    if num == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    splits = decode_splits(num, num_kv_heads)
    m = torch.empty(num, num_heads, splits, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty(num, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ids = seq_ids if seq_ids is not None else meta.seq_lens  # placeholder pointer when unused
    _decode_partial_kernel[(num, num_kv_heads, splits)](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, ids,
        m, lse, acc,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_tables.stride(0),
        splits,
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=meta.block_size, BLOCK_N=DECODE_BLOCK_N, HAS_SEQ_IDS=seq_ids is not None,
        IEEE=q.dtype == torch.float32,
    )
    _decode_merge_kernel[(num, num_heads)](
        m, lse, acc, out, meta.query_start_loc, ids,
        out.stride(0), out.stride(1), splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=splits_pad(splits), HAS_SEQ_IDS=seq_ids is not None,
    )
    return out


def _step_plan(meta) -> dict:
    """Per step (shared by every layer): which sequences decode, which prefill."""
    plan = meta.backend_state.get("cuda_plan")
    if plan is None:
        starts, seq_lens = meta.host_lists()
        decode, prefill = [], []
        for s, ctx_len in enumerate(seq_lens):
            q_len = starts[s + 1] - starts[s]
            if q_len == 1:
                decode.append(s)
            elif q_len > 1:
                prefill.append((s, starts[s], starts[s + 1], ctx_len))
        device = meta.seq_lens.device
        decode_ids = torch.tensor(decode, dtype=torch.int32, device=device) if decode else None
        plan = {"decode_ids": decode_ids, "prefill": prefill}
        meta.backend_state["cuda_plan"] = plan
    return plan


def paged_attention(q, kv_pool, layer, meta, scale, sliding_window=None, k=None, v=None) -> torch.Tensor:
    if meta.max_query_len == 1:  # pure decode: no host work, CUDA-graph safe
        return decode_attention(q, kv_pool, layer, meta, scale, sliding_window)
    plan = _step_plan(meta)
    out = torch.empty_like(q)
    if plan["decode_ids"] is not None:
        decode_attention(q, kv_pool, layer, meta, scale, sliding_window, seq_ids=plan["decode_ids"], out=out)
    k_cache, v_cache = _cache_views(kv_pool, layer)
    block_size = meta.block_size
    for s, q_start, q_end, ctx_len in plan["prefill"]:
        q_len = q_end - q_start
        if ctx_len == q_len and k is not None and v is not None:
            k_ctx, v_ctx = k[q_start:q_end], v[q_start:q_end]
        else:
            blocks = meta.block_tables[s, : -(-ctx_len // block_size)].long()
            k_ctx = k_cache[blocks].flatten(0, 1)[:ctx_len]
            v_ctx = v_cache[blocks].flatten(0, 1)[:ctx_len]
        out[q_start:q_end] = _prefill_one(q[q_start:q_end], k_ctx, v_ctx, scale, sliding_window)
    return out


def _prefill_one(q, k, v, scale, sliding_window):
    """q: [n, H, D] at the last n of the ctx positions in k/v [ctx, Hkv, D]."""
    n, heads = q.shape[0], q.shape[1]
    ctx = k.shape[0]
    group = heads // k.shape[1]
    if group > 1:  # expand once here: keeps the FlashAttention path regardless of its GQA support
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.to(q.dtype), v.to(q.dtype)))
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        if sliding_window is None and ctx == n:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.squeeze(0).transpose(0, 1)
