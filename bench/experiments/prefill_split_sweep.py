"""Short prefill chunks over long cached contexts: the paged prefill kernel per tile shape and context-slice count.

A step budget keeps chunks small (a few hundred tokens beside the decode streams) while a long prompt's context
grows to 32k, so most of its attention runs with few query tiles over many keys. The engine splits the context
into slices (`prefill_splits`) to fill the card; this times the engine's kernel on such shapes (random
Qwen2.5-7B attention shape, bf16, block size 16, shuffled block table) for each tile shape and slice count, and
the engine's own choice and its earlier rule's, so the split rule and the tile table can be checked against the
best found.

    python -m bench.experiments.prefill_split_sweep --out $OUT/prefill_split_sweep.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

import bench.gpu_engine_bench as geb
from bench.experiments.prefill_attention_variants import attention_shape_args, paged_case
from bench.portable import portable

CASES = [(95, 24576), (223, 8192), (223, 16384), (223, 28672), (479, 16384), (991, 24576), (1600, 20800)]
CONFIGS = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3)]
SPLITS = list(range(1, 17)) + [24, 32]


def previous_splits(num_tiles: int, num_heads: int, max_context: int) -> int:
    """The engine's earlier rule: enough slices for two programs per SM of a 132-SM card, at least 1024 keys each."""
    programs = num_tiles * num_heads
    if programs >= 264:
        return 1
    return max(1, min(16, -(-264 // programs), max(1, max_context // 1024)))


def run_case(new, cached, heads, kv_heads, dim, block_size, rng) -> list[dict]:
    from token_engine.layers.attention_prefill_cuda import (
        prefill_attention,
        prefill_config,
        prefill_splits,
        prefill_tiles,
    )

    ctx = cached + new
    q, k_cache, v_cache, meta, flops = paged_case(cached, new, heads, kv_heads, dim, block_size, rng)
    scale = dim**-0.5
    rows: list[dict] = []
    ref = None
    with torch.inference_mode():
        engine_config = prefill_config(dim)
        for config in [engine_config] + [c for c in CONFIGS if c != engine_config]:
            seqs, firsts = prefill_tiles([(0, new)], config[0])
            tiles = torch.tensor([seqs, firsts], dtype=torch.int32, device="cuda")
            chosen = prefill_splits(len(seqs), heads, ctx, config[1])
            previous = previous_splits(len(seqs), heads, ctx)
            for splits in sorted(set(SPLITS) | {chosen, previous}):
                out = torch.empty_like(q)

                def fn(config=config, splits=splits, out=out, tiles=tiles):
                    return prefill_attention(q, k_cache, v_cache, meta, tiles[0], tiles[1], scale, None, out,
                                             config=config, num_splits=splits)
                got = fn().float()
                if ref is None:
                    ref = got
                ms = geb.cuda_time_ms(fn, iters=20, warmup=3)
                row = {"new": new, "cached": cached, "config": config, "splits": splits,
                       "engine_choice": config == engine_config and splits == chosen,
                       "previous_choice": config == engine_config and splits == previous,
                       "programs": len(seqs) * heads * splits, "ms": ms, "tflops": flops / ms / 1e9,
                       "max_abs_err": (got - ref).abs().max().item()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    attention_shape_args(p)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rng = random.Random(0)
    rows: list[dict] = []
    for new, cached in CASES:
        rows += run_case(new, cached, args.heads, args.kv_heads, args.head_dim, args.block_size, rng)
    print(f"\n{torch.cuda.get_device_name()}: ms per layer (TFLOP/s), the engine's choice against the best")
    for new, cached in CASES:
        case = [r for r in rows if r["new"] == new and r["cached"] == cached]
        best = min(case, key=lambda r: r["ms"])
        mine = next(r for r in case if r["engine_choice"])
        before = next(r for r in case if r["previous_choice"])
        print(f"  {new:>5} new over {cached:>6}: engine {mine['config']} x{mine['splits']} {mine['ms']:.3f} ms "
              f"({mine['tflops']:.0f}) | earlier rule x{before['splits']} {before['ms']:.3f} ms | best "
              f"{best['config']} x{best['splits']} {best['ms']:.3f} ms ({best['tflops']:.0f})")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable({"device": torch.cuda.get_device_name(), "rows": rows}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
