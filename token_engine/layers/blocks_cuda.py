"""Fused Triton kernels for the CUDA path of token_engine.layers.blocks.

At decode batch sizes a layer's matmuls are bandwidth-bound and every extra elementwise launch is pure
overhead; these kernels fold each chain of small torch ops into one launch:
  rms_norm:      [residual add +] RMSNorm                     (was ~8 launches)
  qk_rotary:     [per-head q/k RMSNorm (Qwen3) +] rotary on q and k [+ K/V into the pool], one program per
                 token (was ~16 plus store_kv)
  silu_and_mul:  SiLU(gate) * up                               (was 3)
Arithmetic is float32 inside; results are rounded once to the activation dtype.
Imported only for CUDA tensors (or under TRITON_INTERPRET=1 for the CPU test of the kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_xs,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SLICES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if SLICES > 0:  # x is a linear layer's float32 partial sums per K slice: its output is their sum, rounded
        x = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SLICES):
            x += tl.load(x_ptr + s * stride_xs + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the activation dtype first: that rounded value is the residual stream
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Returns norm(x) or, with residual, (norm(x + residual), x + residual). x: [T, H] (last dim contiguous),
    or [S, T, H] float32: the partial sums of a split-K linear layer (decode_linear_split), whose sum rounded
    to the residual's dtype is the layer's output; the residual is required then."""
    slices = 0
    if x.dim() == 3:
        if residual is None:
            raise ValueError("rms_norm of split-K partial sums needs the residual (its dtype is the output's)")
        slices = x.shape[0]
    n_rows, n_cols = x.shape[-2:]
    if x.stride(-1) != 1:
        x = x.contiguous()
    dtype = residual.dtype if residual is not None else x.dtype
    out = torch.empty((n_rows, n_cols), dtype=dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res = residual if residual is not None else x
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x, res, weight, out, res_out,
            x.stride(-2), res.stride(0), out.stride(0), res_out.stride(0), x.stride(0) if slices else 0,
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols), SLICES=slices,
        )
    return (out, res_out) if residual is not None else out


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, norm_w_ptr, cos, sin, token, stride_st, stride_sh, stride_dt, stride_dh, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Rotates one token's heads; returns the two rotated halves (activation dtype) for the caller to reuse."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF)
    mask = (h < NUM_HEADS)[:, None]
    src = src_ptr + token * stride_st + h[:, None] * stride_sh + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        inv = tl.rsqrt(var + eps)[:, None]
        dt = dst_ptr.dtype.element_ty
        x1 = (x1 * inv).to(dt).to(tl.float32) * tl.load(norm_w_ptr + j).to(tl.float32)[None, :]
        x2 = (x2 * inv).to(dt).to(tl.float32) * tl.load(norm_w_ptr + HALF + j).to(tl.float32)[None, :]
        x1 = x1.to(dt).to(tl.float32)
        x2 = x2.to(dt).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty)
    dst = dst_ptr + token * stride_dt + h[:, None] * stride_dh + j[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _qk_rotary_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct,
    stride_cb, stride_cs, stride_ch,
    eps,
    NUM_HEADS: tl.constexpr, Q_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HEAD_DIM // 2)
    cos = tl.load(cos_ptr + token * stride_ct + j).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_ct + j).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, qw_ptr, cos, sin, token, stride_qt, stride_qh, stride_qot, stride_qoh, eps,
                  NUM_HEADS, Q_PAD, HEAD_DIM, HAS_NORM)
    k1, k2 = _rotate_heads(k_ptr, k_out_ptr, kw_ptr, cos, sin, token, stride_kt, stride_kh, stride_kot,
                           stride_koh, eps, NUM_KV_HEADS, KV_PAD, HEAD_DIM, HAS_NORM)
    if STORE_KV:  # the step's K (rotated) and V straight into the pool: saves a launch per layer
        HALF: tl.constexpr = HEAD_DIM // 2
        slot = tl.load(slot_ptr + token).to(tl.int64)
        h = tl.arange(0, KV_PAD)
        mask = ((h < NUM_KV_HEADS) & (slot >= 0))[:, None]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + j[None, :]
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v_src = v_ptr + token * stride_vt + h[:, None] * stride_vh + j[None, :]
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def qk_rotary(q, k, cos, sin, q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6,
              v=None, kv_pool=None, layer: int = 0, meta=None):
    """q: [T, H, D], k: [T, Hkv, D] (strided views of the qkv output); cos/sin: [T, D] (halves repeated).

    Returns new contiguous (q, k), optionally RMS-normed per head first (Qwen3), then rotated. With `kv_pool`
    (and v, layer, meta) it also does store_kv's job: rotated K and V into the pool at meta.slot_mapping.
    """
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, kv_heads, dim), dtype=k.dtype, device=k.device)
    has_norm = q_norm_weight is not None
    store = kv_pool is not None
    if store:
        k_cache, v_cache = kv_pool[:, layer, 0], kv_pool[:, layer, 1]
        assert k_cache.stride(-1) == 1 and v.stride(-1) == 1
        slots, block_size = meta.slot_mapping, meta.block_size
    else:
        k_cache = v_cache = v = k_out
        slots, block_size = cos, 1
    if num_tokens:
        _qk_rotary_kernel[(num_tokens,)](
            q, k, v, q_out, k_out, cos, sin,
            q_norm_weight if has_norm else cos, k_norm_weight if has_norm else cos,
            k_cache, v_cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            eps,
            NUM_HEADS=heads, Q_PAD=triton.next_power_of_2(heads), NUM_KV_HEADS=kv_heads,
            KV_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=dim, HAS_NORM=has_norm, STORE_KV=store,
            BLOCK_SIZE=block_size,
        )
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu(gate) to the activation dtype before the product; so do we
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate rows then up rows) -> [T, I]."""
    n_rows, width = x.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows:
        block = 1024
        _silu_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](x, out, x.stride(0), out.stride(0), n_cols,
                                                                   BLOCK=block)
    return out
