"""Inner-loop forms of the paged prefill attention kernel, timed against each other on one GPU.

The engine's kernel (token_engine/layers/attention_prefill_cuda.py) walks a query tile's keys BLOCK_N at a time
through the block table. This experiment holds a copy of that kernel (causal only, no context split) whose inner
loop takes three switches, so that each form is timed on the same shapes in one process, beside the engine's:

- SCALE_IN_EXP: the softmax scale is applied where the row maximum is subtracted (one fused multiply-add per
  score, as FlashAttention-2's Triton tutorial does) instead of scaling the scores first;
- ACC_IN_DOT: P @ V accumulates into the rescaled accumulator inside the matrix product (``tl.dot(p, v, acc)``)
  instead of adding the product's result to it;
- K_ROWS: K is loaded as [BLOCK_N, HEAD_DIM] (rows of the pool) and transposed in the product, instead of
  being loaded as [HEAD_DIM, BLOCK_N].

All three off is the engine's kernel before it took SCALE_IN_EXP and K_ROWS (on an H100 those two with 128x128
tiles and 3 stages were 1.25-1.3x faster than it on every case).

Cases (random Qwen2.5-7B attention shape, bf16, block size 16, shuffled block table): a fresh 32k prompt, an
agent turn (1600 new over 20800 cached) and an 8k chunk over 24k cached. Every output is compared with the
engine's kernel; each form is timed with several tile shapes. Prints one JSON line per (case, form, shape).

    python -m bench.experiments.prefill_attention_variants --out $OUT/prefill_attention_variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys

import torch
import triton
import triton.language as tl

import bench.gpu_engine_bench as geb
from bench.portable import portable

LOG2E = 1.4426950408889634


@triton.jit
def _variant_tile(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q, n_lo, n_hi, ctx_len, qk_scale,
    stride_cb, stride_ct,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SCALE_IN_EXP: tl.constexpr,
    ACC_IN_DOT: tl.constexpr, K_ROWS: tl.constexpr,
):
    for n in range(n_lo, n_hi, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        if MASKED:
            in_ctx = pos < ctx_len
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        off = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_off
        if MASKED:
            v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
            if K_ROWS:
                k = tl.trans(tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0))
            else:
                k = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=in_ctx[None, :], other=0.0)
        else:
            v = tl.load(v_cache_ptr + off[:, None] + d[None, :])
            if K_ROWS:
                k = tl.trans(tl.load(k_cache_ptr + off[:, None] + d[None, :]))
            else:
                k = tl.load(k_cache_ptr + off[None, :] + d[:, None])
        s = tl.dot(q, k)
        if MASKED:  # causal only here (the engine's kernel also masks windows)
            s = s * qk_scale
            seen = (pos[None, :] <= pos_q[:, None]) & in_ctx[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
        elif SCALE_IN_EXP:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        else:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
            p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if ACC_IN_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _variant_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, q_start_ptr, tile_seq_ptr,
    tile_m_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SCALE_IN_EXP: tl.constexpr, ACC_IN_DOT: tl.constexpr, K_ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    ctx_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_begin
    first_pos = ctx_len - q_len
    m = m0 + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    pos_q = first_pos + m
    rows = (q_begin + m).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_mask[:, None], other=0.0)
    kv_off = (head // GROUP) * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    hi = tl.minimum(ctx_len, first_pos + tl.minimum(m0 + BLOCK_M, q_len))
    full = (first_pos + m0 + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = _variant_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q, 0,
                                  tl.minimum(full, hi), ctx_len, qk_scale, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N,
                                  False, SCALE_IN_EXP, ACC_IN_DOT, K_ROWS)
    acc, l_i, m_i = _variant_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_off, d, pos_q, full, hi,
                                  ctx_len, qk_scale, stride_cb, stride_ct, BLOCK_SIZE, BLOCK_N, True, SCALE_IN_EXP,
                                  ACC_IN_DOT, K_ROWS)
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def variant_attention(q, k_cache, v_cache, meta, tiles, scale, out, config, form) -> torch.Tensor:
    """One query tile per program, no context split (the cases here have enough tiles to fill the card)."""
    block_m, block_n, warps, stages = config
    scale_in_exp, acc_in_dot, k_rows = form
    num_heads, head_dim = q.shape[1], q.shape[2]
    _variant_kernel[(int(tiles.shape[1]), num_heads)](
        q, out, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles[0], tiles[1],
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), meta.block_tables.stride(0), GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim,
        BLOCK_SIZE=meta.block_size, BLOCK_M=block_m, BLOCK_N=block_n, SCALE_IN_EXP=scale_in_exp,
        ACC_IN_DOT=acc_in_dot, K_ROWS=k_rows, num_warps=warps, num_stages=stages,
    )
    return out


CASES = [("fresh_32k", 0, 32768), ("agent_turn", 20800, 1600), ("chunk_8k_over_24k", 24576, 8192)]
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
FORMS = list(itertools.product((False, True), repeat=3))  # (SCALE_IN_EXP, ACC_IN_DOT, K_ROWS)


def paged_case(cached, new, heads, kv_heads, dim, block_size, rng):
    """A chunk of `new` queries over `cached` keys in a random bf16 pool with a shuffled block table: (q, k_cache,
    v_cache, metadata, FLOPs)."""
    from token_engine.layers.attention import build_metadata

    ctx = cached + new
    nblk = -(-ctx // block_size)
    pool = torch.randn(nblk + 3, 2, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    meta = build_metadata([new], [ctx], [rng.sample(range(nblk + 3), nblk)], block_size, "cuda")
    q = torch.randn(new, heads, dim, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * heads * dim * new * (cached + (new + 1) / 2)
    return q, pool[:, 0], pool[:, 1], meta, flops


def attention_shape_args(p: argparse.ArgumentParser) -> None:
    """The attention shape of the cases (default: Qwen2.5-7B's) and the pool's block size."""
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)


def run_case(name, cached, new, heads, kv_heads, dim, block_size, rng) -> list[dict]:
    from token_engine.layers.attention_prefill_cuda import prefill_attention, prefill_tiles

    q, k_cache, v_cache, meta, flops = paged_case(cached, new, heads, kv_heads, dim, block_size, rng)
    scale = dim**-0.5
    rows = []
    with torch.inference_mode():
        seqs, firsts = prefill_tiles([(0, new)], 128)
        tiles = torch.tensor([seqs, firsts], dtype=torch.int32, device="cuda")
        engine_out = torch.empty_like(q)

        def engine():
            return prefill_attention(q, k_cache, v_cache, meta, tiles[0], tiles[1], scale, None, engine_out)
        ref = engine().float()
        ms = geb.cuda_time_ms(engine, iters=10, warmup=2)
        rows.append({"case": name, "form": "engine", "ms": ms, "tflops": flops / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        for config in CONFIGS:
            seqs, firsts = prefill_tiles([(0, new)], config[0])
            tiles_c = torch.tensor([seqs, firsts], dtype=torch.int32, device="cuda")
            for form in FORMS:
                out = torch.empty_like(q)

                def fn(config=config, form=form, out=out, tiles_c=tiles_c):
                    return variant_attention(q, k_cache, v_cache, meta, tiles_c, scale, out, config, form)
                row = {"case": name, "form": dict(zip(("scale_in_exp", "acc_in_dot", "k_rows"), form)),
                       "config": config}
                try:
                    row["max_abs_err"] = (fn().float() - ref).abs().max().item()
                    row["ms"] = geb.cuda_time_ms(fn, iters=10, warmup=2)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001 - a shape this card cannot hold is a result too
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    attention_shape_args(p)
    p.add_argument("--cases", default=",".join(c[0] for c in CASES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    wanted = set(args.cases.split(","))
    rng = random.Random(0)
    result: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    for name, cached, new in CASES:
        if name in wanted:
            result["rows"] += run_case(name, cached, new, args.heads, args.kv_heads, args.head_dim, args.block_size,
                                       rng)
    best: dict = {}
    for r in result["rows"]:
        if "ms" in r and r.get("max_abs_err", 0.0) < 0.05:
            if r["case"] not in best or r["ms"] < best[r["case"]]["ms"]:
                best[r["case"]] = r
    result["best"] = best
    print(json.dumps({"best": best}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(portable(result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
