"""FlashAttention-3 (vLLM's compiled build) against the paged prefill kernel and cuDNN, one layer of attention.

The engine's prefill attention is a Triton kernel reading the paged KV pool in place
(token_engine/layers/attention_prefill_cuda.py); cuDNN's attention runs faster on a fresh prompt but needs
contiguous K/V and an execution plan per shape. FA3 (token_engine/layers/attention_fa3.py) reads the same pool
through a page table. This experiment loads the FA3 library (TOKEN_ENGINE_FA3_LIBRARY: a path, or `vllm` for
an installed vllm's copy; `--library` sets the variable), then on the Qwen2.5-7B attention shape (28 query
heads, 4 KV heads, head_dim 128, bf16, block size 16, a shuffled block table, a pool of two layers read at its
second so pages have the pool's stride):

1. correctness: a ragged step (a fresh prompt, chunks over cached prefixes that end inside blocks, a decode
   row), bf16 and fp16, with and without a sliding window, against the CPU path's code in float32; whether
   FA3 leaves the decode row (given no queries) alone;
2. per case (a fresh 32k prompt, a fresh 8k prompt, an agent turn of 1600 new tokens over 20800 cached, an 8k
   chunk over 24k cached): the paged kernel, FA3 (its own context split, and none) and, for fresh prompts,
   cuDNN and flash through torch's SDPA on contiguous K/V, timed with CUDA events (median of 10), in TFLOP/s
   of causal attention; each output against a float32 reference on sampled query rows, and FA3 against the
   paged kernel on every row;
3. whether an FA3 call replays from a CUDA graph with the same output.

    python -m bench.experiments.fa3_prefill_attention --library PATH --out $OUT/fa3_prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
from torch.nn import functional as F

import bench.gpu_engine_bench as geb
from bench.experiments.prefill_attention_variants import attention_shape_args
from bench.portable import portable

CASES = [("fresh 32k", 0, 32768), ("fresh 8k", 0, 8192), ("agent turn", 20800, 1600), ("8k over 24k", 24576, 8192)]


def make_case(cached, new, heads, kv_heads, dim, block_size, rng, dtype=torch.bfloat16, layers=2):
    from token_engine.layers.attention import build_metadata

    ctx = cached + new
    nblk = -(-ctx // block_size)
    pool = torch.randn(nblk + 3, layers, 2, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    table = rng.sample(range(nblk + 3), nblk)
    meta = build_metadata([new], [ctx], [table], block_size, "cuda")
    q = torch.randn(new, heads, dim, device="cuda", dtype=dtype)
    return q, pool, meta, table


def reference_rows(q, k, v, first_pos, rows, scale, window=None):
    """float32 attention of q[rows] (positions first_pos + rows) over k/v [ctx, kv_heads, dim]."""
    group = q.shape[1] // k.shape[1]
    qr = q[rows].float().transpose(0, 1)  # [H, r, D]
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)
    pos = (first_pos + rows)[:, None]
    keys = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = keys <= pos
    if window:
        mask &= keys > pos - window
    o = F.scaled_dot_product_attention(qr, kf, vf, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def ragged_check(heads, kv_heads, dim, block_size, dtype, window) -> dict:
    """A verify_prefill-like step through FA3 against the CPU path's code in float32."""
    from token_engine.layers import attention_fa3
    from token_engine.layers.attention import _paged_attention_reference, build_metadata

    gen = torch.Generator(device="cuda").manual_seed(0)
    cached, new = [0, 37, 3 * block_size, 200], [150, 70, 1, 33]
    lens = [c + n for c, n in zip(cached, new)]
    per_seq = [-(-n // block_size) for n in lens]
    pool = torch.randn(sum(per_seq) + 1, 2, 2, block_size, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    ids = torch.randperm(pool.shape[0], generator=gen, device="cuda").tolist()
    tables = [ids[sum(per_seq[:i]): sum(per_seq[: i + 1])] for i in range(len(lens))]
    meta = build_metadata(new, lens, tables, block_size, "cuda")
    q = torch.randn(sum(new), heads, dim, generator=gen, device="cuda").to(dtype)
    scale = dim**-0.5
    want = _paged_attention_reference(q.float(), pool.float(), 1, meta, scale, window)
    out = torch.zeros_like(q)
    seqused_q, max_q = attention_fa3.step_args(new, q.device)
    attention_fa3.prefill(q, pool[:, 1, 0], pool[:, 1, 1], meta.query_start_loc, seqused_q, meta.seq_lens,
                          meta.block_tables, max_q, max(lens), scale, window, out)
    decode_row = sum(new[:2])
    rows = [r for r in range(sum(new)) if r != decode_row]
    err = (out[rows].float() - want[rows]).abs().max().item()
    return {"dtype": str(dtype), "window": window, "max_abs_err": err,
            "decode_row_untouched": bool((out[decode_row] == 0).all().item())}


def attention_flops(heads, dim, new, cached):
    return 4.0 * heads * dim * new * (cached + (new + 1) / 2)


def run_case(name, cached, new, heads, kv_heads, dim, block_size, rng) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from token_engine.layers import attention_cuda as ac
    from token_engine.layers import attention_fa3

    q, pool, meta, table = make_case(cached, new, heads, kv_heads, dim, block_size, rng)
    ctx = cached + new
    layer = 1
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    blocks = torch.tensor(table, device="cuda").long()
    kc = k_cache[blocks].flatten(0, 1)[:ctx]
    vc = v_cache[blocks].flatten(0, 1)[:ctx]
    scale = dim**-0.5
    flops = attention_flops(heads, dim, new, cached)
    row: dict = {"case": name, "cached": cached, "new": new, "floor_ms": flops / geb.HW["bf16_flops_per_s"] * 1e3}
    sample = sorted(set(list(range(128)) + list(range(new - 128, new)) + rng.sample(range(new), min(new, 128))))
    sample_t = torch.tensor(sample, device="cuda")
    with torch.inference_mode():
        ref = reference_rows(q, kc, vc, cached, sample_t, scale)

        def ours():
            meta.backend_state.clear()
            return ac.paged_attention(q, pool, layer, meta, scale)

        fa3_out = torch.empty_like(q)

        def fa3(splits=0):
            return attention_fa3.prefill(q, k_cache, v_cache, meta.query_start_loc, None, meta.seq_lens,
                                         meta.block_tables, new, ctx, scale, None, fa3_out, num_splits=splits)

        def sdpa(backend):
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, kc, vc))

            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                          enable_gqa=True)[0].transpose(0, 1)
            return run

        paths = [("ours", ours), ("fa3", fa3), ("fa3_no_split", lambda: fa3(1))]
        if cached == 0:
            paths += [("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa_flash", sdpa(SDPBackend.FLASH_ATTENTION))]
        ours_out = None
        for label, fn in paths:
            try:
                out = fn()
                row[f"{label}_max_abs_err"] = (out[sample_t].float() - ref).abs().max().item()
                if label == "ours":
                    ours_out = out.clone()
                elif ours_out is not None:
                    row[f"{label}_vs_ours_max_abs"] = (out.float() - ours_out.float()).abs().max().item()
                ms = geb.cuda_time_ms(fn, iters=10, warmup=2)
                row[f"{label}_ms"] = ms
                row[f"{label}_tflops"] = flops / (ms / 1e3) / 1e12
            except Exception as exc:  # noqa: BLE001 - a path that fails here is a result too
                row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if name == "agent turn":
            row["graph"] = graph_check(fa3)
    print(json.dumps(row), flush=True)
    return row


def graph_check(fn) -> dict:
    """Captures one FA3 call in a CUDA graph and replays it against the eager output."""
    try:
        want = fn().clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fn()
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return {"captured": True, "replay_max_abs_diff": (got.float() - want.float()).abs().max().item()}
    except Exception as exc:  # noqa: BLE001
        return {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--library", default=None,
                   help="path of _vllm_fa3_C.abi3.so, or vllm (sets TOKEN_ENGINE_FA3_LIBRARY)")
    attention_shape_args(p)
    p.add_argument("--cases", default=",".join(c[0] for c in CASES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.library:
        os.environ["TOKEN_ENGINE_FA3_LIBRARY"] = args.library
    from token_engine.layers import attention_fa3

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "library": attention_fa3.locate()[0]}
    why = attention_fa3.load()
    result["load_error"] = why
    print(json.dumps({"device": result["device"], "torch": result["torch"], "load_error": why}), flush=True)
    if why is None:
        geb.HW.update(geb.measure_ceilings())
        result["ceilings"] = dict(geb.HW)
        result["ragged"] = []
        for dtype in (torch.bfloat16, torch.float16):
            for window in (None, 50):
                try:
                    result["ragged"].append(ragged_check(args.heads, args.kv_heads, args.head_dim, args.block_size,
                                                         dtype, window))
                except Exception as exc:  # noqa: BLE001
                    result["ragged"].append({"dtype": str(dtype), "window": window,
                                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                print(json.dumps(result["ragged"][-1]), flush=True)
        wanted = set(args.cases.split(","))
        rng = random.Random(0)
        result["cases"] = []
        for name, cached, new in CASES:
            if name in wanted:
                result["cases"].append(run_case(name, cached, new, args.heads, args.kv_heads, args.head_dim,
                                                args.block_size, rng))
                geb.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(portable(result), f, indent=1)
    for r in result.get("cases", []):
        cells = [f"{k[:-3]} {r[k]:.2f} ms {r[k[:-3] + '_tflops']:.0f} TFLOP/s" for k in r
                 if k.endswith("_ms") and k != "floor_ms"]
        print(f"{r['case']:>12}: floor {r['floor_ms']:.2f} | " + " | ".join(cells))
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
