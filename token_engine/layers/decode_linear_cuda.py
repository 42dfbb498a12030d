"""Linear layers for decode-sized batches (at most 32 rows) on CUDA.

At decode a linear layer reads its whole weight for a handful of activation rows, so its time is the weight
bytes over HBM bandwidth plus a fixed cost per kernel. For some of a 7B model's layers cuBLAS leaves
bandwidth unused at this size (the o projection goes through a split-K kernel and a second reduction
kernel), and the SiLU gate between gate_up and down is one more launch. This kernel streams the weight
once per call, with each program owning BLOCK_N output features over all of K, and with `gated` computes
SiLU(x @ W_gate.T) * (x @ W_up.T) for the gate_up projection in the same pass (no silu_and_mul kernel).
decode_linear_split instead spreads K over several programs per feature tile and leaves float32 partial sums
for the next kernel (the add + RMSNorm after o and down) to add up: more programs in flight for the layers
whose whole-K grid leaves SMs idle (3584 features in tiles of 32 are 112 programs on 132 SMs).

Which layers use it and with which launch config is decided per shape and row count by measurement
(bench/experiments/decode_floor.py, TUNED and SPLIT_TUNED below); a shape measured slower than cuBLAS is sent
to cuBLAS.

Rounding follows the unfused path: each matmul output is rounded to the activation dtype, then SiLU is
rounded, then the product, so results differ from cuBLAS only in the order of the float32 sums. The
activation rows are padded to 16 or 32 for the tensor-core dot and re-read from L2 by every program, which costs
nothing next to the weight bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

MAX_ROWS = 32

Config = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages

# (out features, in features, gated, activation rows padded: 16 or 32) -> launch config, or None where cuBLAS
# measured faster. Measured for Qwen2.5-7B's shapes over all 28 layers in one CUDA graph, us per layer, o and
# down with the add + RMSNorm after them (bench/experiments/decode_floor.py;
# bench/results/decode_floor_nvidia-h100.json, an H100; the three 16-wide tiles with two warps from
# decode_floor_nvidia-h100_more_configs.json, another H100); other shapes get DEFAULT_CONFIG.
TUNED: dict[tuple[int, int, bool, int], Config | None] = {
    (4608, 3584, False, 16): (16, 256, 2, 4),  # q/k/v with bias: 14.4, cuBLAS 14.7
    (4608, 3584, False, 32): None,  # cuBLAS 14.8, ours 16.2
    (3584, 3584, False, 16): (32, 256, 4, 5),  # o: 13.6, cuBLAS 13.8 (split K + a reduction kernel)
    (3584, 3584, False, 32): (32, 256, 4, 4),  # 14.0, cuBLAS 14.3
    (18944, 3584, True, 16): (32, 256, 4, 4),  # gate_up + SiLU: 89.7, cuBLAS + silu_and_mul 96.0
    (18944, 3584, True, 32): (16, 256, 2, 4),  # 96.2, (64, 128, 4, 4) 100.8, cuBLAS + silu_and_mul 106.1
    (3584, 18944, False, 16): (32, 256, 4, 5),  # down: 49.8, cuBLAS 54.5
    (3584, 18944, False, 32): (32, 256, 4, 5),  # 51.9, cuBLAS 54.9
    (152064, 3584, False, 16): (16, 256, 2, 4),  # lm_head: 353.8, (64, 256, 4, 3) 356 or more, cuBLAS 381
    (152064, 3584, False, 32): (64, 256, 4, 3),  # 365, cuBLAS 377
}
DEFAULT_CONFIG: Config = (32, 256, 4, 4)
# (out features, in features, rows padded) -> (launch config, K slices) for a layer whose output feeds an add +
# RMSNorm (o, down): the kernel writes float32 partial sums per K slice and the norm's kernel adds them, so more
# programs stream the weight at no extra launch. Layers without an entry (or with a bias) take decode_linear.
# Empty: in the same measurement the best split lost to the best whole-K config by a hair (down, 1 row: 49.9
# against 49.8 us; o: 13.8 against 13.6). On an H200, before whole-K got its constant loop bounds back, split K
# won for down (bench/results/decode_floor_sweep_nvidia-h200.json): measure there before adding entries.
SPLIT_TUNED: dict[tuple[int, int, int], tuple[Config, int]] = {}


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program; Hopper has 227 KB per block


def launch_config(n_out: int, k_dim: int, gated: bool, rows: int = 1) -> Config | None:
    return TUNED.get((n_out, k_dim, gated, _rows_pad(rows)), DEFAULT_CONFIG)


def fit_shared_memory(config: Config, element_size: int, gated: bool, rows_pad: int = 16) -> Config:
    """Shrinks a config (tuned on bfloat16) until its pipelined tiles fit: float32 doubles every tile."""
    block_n, block_k, num_warps, num_stages = config

    def tile_bytes():
        return num_stages * ((2 if gated else 1) * block_n + rows_pad) * block_k * element_size

    while tile_bytes() > SHARED_MEMORY_BUDGET and num_stages > 2:
        num_stages -= 1
    while tile_bytes() > SHARED_MEMORY_BUDGET and block_k > 32:
        block_k //= 2
    return block_n, block_k, num_warps, num_stages


@triton.jit(do_not_specialize=["tiles_per_split"])
def _decode_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, tiles_per_split,
    stride_xm, stride_wn, stride_ym, stride_ys,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, ROWS)
    m_mask = m < M
    dt = x_ptr.dtype.element_ty
    # PARTIAL: program (n tile, s) sums K slice s only and stores float32 partial sums at y[s] (split K). The
    # slice start is a multiple of BLOCK_K by construction, which keeps the weight loads 16 bytes wide (an
    # unspecialized start in elements measured 2-3x slower); only K's end needs a mask.
    if PARTIAL:
        k_start = tl.program_id(1) * tiles_per_split * BLOCK_K
        k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    else:  # constant bounds, as before split K existed (the whole-K configs were tuned with them)
        k_start = 0
        k_end = K

    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xk = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
        if IEEE:
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xk, tl.trans(w))
        if GATED:  # the up row of feature n sits N rows below its gate row
            wu = tl.load(w_ptr + (n + N)[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
            if IEEE:
                acc_up += tl.dot(xk, tl.trans(wu), input_precision="ieee")
            else:
                acc_up += tl.dot(xk, tl.trans(wu))

    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        dst = y_ptr + tl.program_id(1).to(tl.int64) * stride_ys + m[:, None] * stride_ym + n[None, :]
        tl.store(dst, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dt)
        if GATED:  # as silu_and_mul on the rounded gate_up output: SiLU rounded, then the product rounded
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            out = (act * acc_up.to(dt).to(tl.float32)).to(dt)
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], out, mask=out_mask)


def _rows_pad(rows: int) -> int:
    """The activation tile's height: 16 (the tensor-core dot's least) or 32."""
    return 16 if rows <= 16 else 32


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    config: Config | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias for x: [M <= 32, K]. gated: weight holds gate rows then up rows ([2N, K]) and the
    result is SiLU(gate) * up, [M, N]. `config` overrides the tuned launch config."""
    rows, k_dim = _check(x, weight)
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    cfg = config or launch_config(n_out, k_dim, gated, rows)
    if cfg is None:  # cuBLAS measured faster for this shape
        y = F.linear(x, weight, bias)
        if gated:
            from token_engine.layers.blocks_cuda import silu_and_mul

            y = silu_and_mul(y)
        return y
    y = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    if rows:
        _launch(x, weight, bias, y, cfg, gated, splits=1)
    return y


def split_config(n_out: int, k_dim: int, rows: int) -> tuple[Config, int] | None:
    return SPLIT_TUNED.get((n_out, k_dim, _rows_pad(rows)))


def decode_linear_split(x: torch.Tensor, weight: torch.Tensor, splits: int, config: Config) -> torch.Tensor:
    """x @ weight.T as `splits` float32 partial sums over slices of K: [splits, M, N]. Their sum, rounded to
    x's dtype, is decode_linear's result up to float32 summation order; the consumer adds them up
    (blocks_cuda.rms_norm takes them in place of its input)."""
    rows, k_dim = _check(x, weight)
    block_k = fit_shared_memory(config, x.element_size(), False, _rows_pad(rows))[1]
    slices = triton.cdiv(k_dim, _tiles_per_split(k_dim, splits, block_k) * block_k)  # whole tiles: may drop one
    y = torch.empty((slices, rows, weight.shape[0]), dtype=torch.float32, device=x.device)
    if rows:
        _launch(x, weight, None, y, config, False, splits)
    return y


def _tiles_per_split(k_dim: int, splits: int, block_k: int) -> int:
    return triton.cdiv(triton.cdiv(k_dim, block_k), splits)


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    rows, k_dim = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"decode_linear takes at most {MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != k_dim:
        raise ValueError(f"decode_linear: input width {k_dim} does not fit weight {tuple(weight.shape)}")
    return rows, k_dim


def _launch(x, weight, bias, y, cfg: Config, gated: bool, splits: int) -> None:
    rows, k_dim = x.shape
    pad = _rows_pad(rows)
    block_n, block_k, num_warps, num_stages = fit_shared_memory(cfg, x.element_size(), gated, pad)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    tiles = _tiles_per_split(k_dim, splits, block_k)
    partial = y.dim() == 3
    _decode_linear_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(k_dim, tiles * block_k))](
        x, weight, bias if bias is not None else weight, y,
        rows, n_out, k_dim, tiles,
        x.stride(0), weight.stride(0), y.stride(-2), y.stride(0) if partial else 0,
        ROWS=pad, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, GATED=gated, IEEE=x.dtype == torch.float32, PARTIAL=partial,
        num_warps=num_warps, num_stages=num_stages,
    )
