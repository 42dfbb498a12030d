"""CUDA backend of token_engine.layers.attention: same contract, faster.

- store_kv: one Triton program per new token copies its K and V rows into the pool; slots < 0 are skipped
  (the padded rows of a CUDA-graph decode batch).
- decode (every sequence has one new token): a split-K ("flash decoding") Triton kernel. Each program takes
  one sequence, one KV head (all the query heads that share it, so K/V are read once per group) and one slice
  of the context, gathering tokens through the block table; a second kernel merges the slices' partial
  softmax states. No host syncs and no data-dependent launch shapes, so it is capturable in a CUDA graph.
  The number of slices is a runtime argument (only the merge's padded width is compiled in): were it a
  compile-time constant, every new count of decoding sequences in a mixed step would compile a kernel
  (0.6-3 s on an H200, measured by bench/experiments/gpu_decode_profile.py) while requests wait.
- prefill (some sequence has several new tokens): token_engine.layers.attention_prefill_cuda, one launch for every
  prefill chunk of the step, reading the pool in place (block tables, native GQA, causal by position); or,
  where TOKEN_ENGINE_FA3_LIBRARY names FlashAttention-3 and it passed its start-up check (PREFILL_FA3), one FA3 call
  (token_engine.layers.attention_fa3) for the eager steps' chunks. Sequences of the step with a single new
  token go through the decode kernel.

Importing this module needs triton; token_engine.layers.attention imports it only for CUDA tensors. With
TRITON_INTERPRET=1 the kernels also run on CPU tensors (that is how the CPU test suite checks them when triton
is installed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from token_engine.layers.attention_prefill_cuda import prefill_attention, prefill_config, prefill_tiles

# Decode: tokens per inner iteration, and a target of programs in flight (H200: 132 SMs).
DECODE_BLOCK_N = 64
# Keys per iteration where a sequence's context is cut into at most 4 slices (large batches). Qwen2.5-7B's shape,
# batch 32 over 1k of context (bench/experiments/decode_floor.py): on an H100 64 keys 32.1 us per layer, 128 keys
# 33.1; on an H200, in a run with other launch settings, 128 keys 28.8 against 31.5.
DECODE_BLOCK_N_FEW_SPLITS = 64
TARGET_PROGRAMS = 2 * 132
MAX_SPLITS = 32
# (warps, pipeline stages) of the partial kernel, many slices / at most 4: Triton's defaults. Other counts and
# slice targets won 2-7% of the kernel alone and nothing measurable in whole decode steps
# (bench/experiments/decode_attention_sweep.py, docs/token-engine.md).
DECODE_WARPS_STAGES = (4, 3)
DECODE_WARPS_STAGES_FEW_SPLITS = (4, 3)
# Prefill attention backends, cuDNN left out: it builds an execution plan for every new shape, and a chunk's
# length and context change from step to step under load, so steps took 0.1-2.5 s instead of ~50 ms on an
# H200 (bench/experiments/gpu_decode_profile.py, mixed_step). Flash and memory-efficient kernels need no plan.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Fresh prompts (nothing cached) through torch's SDPA on the step's own K/V instead of the paged prefill kernel.
# Off: the paged kernel serves every prefill chunk (bench/long_prompt_bench.py compares the two).
FRESH_PREFILL_SDPA = False
# Cleared when the paged prefill kernel fails its startup check (warm_up): prefill then takes the CPU path's
# code on the GPU (slow, correct).
PREFILL_KERNEL_OK = True
PREFILL_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}
# Fresh prompts of at least this many tokens through cuDNN's attention (about 1.8x the flash and paged kernels'
# rate at 32k on an H200), padded up to a multiple of CUDNN_BUCKET so that a handful of execution plans (one
# per bucket; each costs a build on first use) serve every length. Padding goes after the prompt, where causal
# masking hides it from every real query. 0: off.
FRESH_PREFILL_CUDNN_MIN = 0
CUDNN_BUCKET = 4096
# Set by the start-up check (token_engine.layers.attention.warm_up_cuda) when the FA3 library loaded and matched
# the reference: the prefill chunks of eager steps then go through FA3. Steps replayed as CUDA graphs carry a
# precomputed plan without it (token_engine.core.mixed_graphs) and keep the paged kernel.
PREFILL_FA3 = False


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
    few = splits <= 4
    warps, stages = DECODE_WARPS_STAGES_FEW_SPLITS if few else DECODE_WARPS_STAGES
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
        BLOCK_SIZE=meta.block_size, BLOCK_N=DECODE_BLOCK_N_FEW_SPLITS if few else DECODE_BLOCK_N,
        HAS_SEQ_IDS=seq_ids is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    _decode_merge_kernel[(num, num_heads)](
        m, lse, acc, out, meta.query_start_loc, ids,
        out.stride(0), out.stride(1), splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=splits_pad(splits), HAS_SEQ_IDS=seq_ids is not None,
    )
    return out


def _step_plan(meta, head_dim: int) -> dict:
    """Per step (shared by every layer): which sequences decode, and the prefill query tiles."""
    plan = meta.backend_state.get("cuda_plan")
    if plan is None:
        starts, seq_lens = meta.host_lists()
        decode, prefill, fresh = [], [], []
        for s, ctx_len in enumerate(seq_lens):
            q_len = starts[s + 1] - starts[s]
            if q_len == 1:
                decode.append(s)
            elif q_len > 1:
                prefill.append((s, q_len))
                if ctx_len == q_len:
                    fresh.append((s, starts[s], starts[s + 1]))
        device = meta.seq_lens.device
        decode_ids = torch.tensor(decode, dtype=torch.int32, device=device) if decode else None
        if FRESH_PREFILL_SDPA or FRESH_PREFILL_CUDNN_MIN:
            if not FRESH_PREFILL_SDPA:
                fresh = [f for f in fresh if f[2] - f[1] >= FRESH_PREFILL_CUDNN_MIN]
            fresh_ids = {s for s, _, _ in fresh}
            prefill = [(s, n) for s, n in prefill if s not in fresh_ids]
        else:
            fresh = []
        fa3 = None
        if PREFILL_FA3 and prefill:  # every prefill chunk through FA3, fresh or over a cached prefix
            from token_engine.layers import attention_fa3

            seqused_q, max_q = attention_fa3.step_args([starts[s + 1] - starts[s] for s in range(len(seq_lens))],
                                                       device)
            fa3 = (seqused_q, max_q, max(seq_lens))
            prefill, fresh = [], []
        tile_seq, tile_m = prefill_tiles(prefill, prefill_config(head_dim)[0])
        tiles = torch.tensor([tile_seq, tile_m], dtype=torch.int32, device=device) if tile_seq else None
        plan = {"decode_ids": decode_ids, "tiles": tiles, "fresh": fresh, "fa3": fa3}
        meta.backend_state["cuda_plan"] = plan
    return plan


def paged_attention(q, kv_pool, layer, meta, scale, sliding_window=None, k=None, v=None) -> torch.Tensor:
    if meta.max_query_len == 1:  # pure decode: no host work, CUDA-graph safe
        return decode_attention(q, kv_pool, layer, meta, scale, sliding_window)
    plan = _step_plan(meta, q.shape[2])
    out = torch.empty_like(q)
    k_cache, v_cache = _cache_views(kv_pool, layer)
    fa3 = plan.get("fa3")
    if fa3 is not None:
        from token_engine.layers import attention_fa3

        seqused_q, max_q, max_k = fa3
        attention_fa3.prefill(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache, meta.query_start_loc,
                              seqused_q, meta.seq_lens, meta.block_tables, max_q, max_k, scale, sliding_window, out)
    if plan["decode_ids"] is not None:
        decode_attention(q, kv_pool, layer, meta, scale, sliding_window, seq_ids=plan["decode_ids"], out=out)
    tiles = plan["tiles"]
    if tiles is not None:  # every prefill chunk of the step, over its cached prefix too, in one launch
        prefill_attention(q, k_cache, v_cache, meta, tiles[0], tiles[1], scale, sliding_window, out,
                          num_splits=plan.get("splits"))
    for _, q_start, q_end in plan["fresh"]:
        if FRESH_PREFILL_CUDNN_MIN and sliding_window is None and q_end - q_start >= FRESH_PREFILL_CUDNN_MIN:
            out[q_start:q_end] = _prefill_fresh_cudnn(q[q_start:q_end], k[q_start:q_end], v[q_start:q_end], scale)
        else:
            out[q_start:q_end] = _prefill_fresh_sdpa(q[q_start:q_end], k[q_start:q_end], v[q_start:q_end], scale,
                                                     sliding_window)
    return out


def _prefill_fresh_cudnn(q, k, v, scale):
    """A long fresh prompt through cuDNN, padded to a bucket: [n, H, D] -> [n, H, D]."""
    n = q.shape[0]
    padded = -(-n // CUDNN_BUCKET) * CUDNN_BUCKET

    def heads_first(t):
        t = t.transpose(0, 1).unsqueeze(0)
        return F.pad(t, (0, 0, 0, padded - n)) if padded > n else t

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(heads_first(q), heads_first(k.to(q.dtype)), heads_first(v.to(q.dtype)),
                                           is_causal=True, scale=scale, enable_gqa=True)
    return o[0, :, :n].transpose(0, 1)


def _prefill_rows(meta) -> list[tuple[int, int]]:
    """(first row, rows) of every sequence with several new tokens."""
    starts, _ = meta.host_lists()
    return [(starts[s], starts[s + 1] - starts[s]) for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > 1]


def verify_prefill(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   device, build_metadata, reference, sliding_window: int | None = None) -> float:
    """Runs the paged prefill kernel (or FA3, while PREFILL_FA3 is set) on a small ragged step (a fresh prompt,
    chunks over cached prefixes that end inside pool blocks, a decode), whole and with the context in slices,
    against the CPU path's code in float32; returns the largest error.
    Uses its own small pool; compiles the kernel for this model's shape before any request."""
    gen = torch.Generator(device=device).manual_seed(0)
    cached, new = [0, 37, 3 * block_size], [150, 70, 1]
    lens = [c + n for c, n in zip(cached, new)]
    per_seq = [-(-n // block_size) for n in lens]
    pool = torch.randn(sum(per_seq) + 1, 1, 2, block_size, num_kv_heads, head_dim, generator=gen, device=device)
    pool = pool.to(dtype)
    ids = torch.randperm(pool.shape[0], generator=gen, device=device).tolist()
    tables = [ids[sum(per_seq[:i]) : sum(per_seq[: i + 1])] for i in range(len(lens))]
    meta = build_metadata(new, lens, tables, block_size, device)
    q = torch.randn(sum(new), num_heads, head_dim, generator=gen, device=device).to(dtype)
    got = paged_attention(q, pool, 0, meta, head_dim**-0.5, sliding_window)
    want = reference(q.float(), pool.float(), 0, meta, head_dim**-0.5, sliding_window)
    meta.backend_state["cuda_plan"]["splits"] = 3  # the context in slices, as long contexts take it
    sliced = paged_attention(q, pool, 0, meta, head_dim**-0.5, sliding_window)
    return max((got.float() - want).abs().max().item(), (sliced.float() - want).abs().max().item())


def _prefill_fresh_sdpa(q, k, v, scale, sliding_window):
    """A fresh prompt (no cached context) through torch's SDPA on the step's own K/V: [n, H, D]."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.to(q.dtype), v.to(q.dtype)))
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        if sliding_window is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(q.shape[0], device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
