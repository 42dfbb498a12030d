"""GPU benchmark of long prompts: paged prefill attention, unchunked and chunked prefill, agent turns, decode.

    python -m bench.long_prompt_bench --preset qwen2.5-7b --out $OUT/long_prompt_bench.json

Everything in one process on one GPU, each figure against its floor measured in the same run:
1. Ceilings: HBM copy bandwidth and the bf16 matmul rate on this card (bench.gpu_engine_bench).
2. Attention alone (the preset's head shape): a chunk over a cached prefix (the agent turn) and fresh prompts,
   through the paged prefill kernel, through the old path (gather the context out of the pool, expand K/V by
   the GQA group, dense mask, SDPA: kept here as `legacy_paged_attention`, the baseline), and through torch's
   SDPA backends on contiguous K/V (flash, cuDNN) as ceilings, and through FlashAttention-3 where its library
   loads (token_engine.layers.attention_fa3: TOKEN_ENGINE_FA3_LIBRARY, a path or `vllm`; the engine's
   dispatch with PREFILL_FA3 on). Each output is checked against a reference.
3. The whole model (random weights of the preset's shape, bf16): one fresh prompt unchunked; the same prompt
   chunked (each chunk over the cached prefix of the ones before: the server's TTFT without HTTP); an agent
   turn (new tokens over a cached prefix); each with the paged kernel, with FA3 where it loads ("fa3"), and with
   the legacy path.
   Floor: matmul FLOPs (2 * params * tokens + causal attention) over the measured matmul rate.
4. Decode steps at batch 1 and 32 through the CUDA graphs, against the HBM floor (bench.gpu_engine_bench).
Prints a table last; writes JSON. `--skip-prefill` runs steps 1 and 4 only (a short decode-only run).
Dry run on CPU: `--device cpu --preset tiny --prompt 256 --chunk 64 --agent-cached 192 --agent-new 48
--batches 1,2` (the kernel paths need CUDA and are skipped there).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings

import torch
from torch.nn import functional as F

from bench import gpu_engine_bench as geb
from bench.portable import portable


def legacy_paged_attention(q, kv_pool, layer, meta, scale, sliding_window=None, k=None, v=None):
    """The CUDA path's prefill before the paged kernel: per sequence, gather, expand, mask, SDPA."""
    from torch.nn.attention import sdpa_kernel

    from token_engine.layers import attention_cuda as ac

    if meta.max_query_len == 1:
        return ac.decode_attention(q, kv_pool, layer, meta, scale, sliding_window)
    starts, seq_lens = meta.host_lists()
    out = torch.empty_like(q)
    k_cache, v_cache = kv_pool[:, layer, 0], kv_pool[:, layer, 1]
    group = q.shape[1] // k_cache.shape[2]
    for s, ctx in enumerate(seq_lens):
        a, b = starts[s], starts[s + 1]
        n = b - a
        if n == 0:
            continue
        if n == ctx and k is not None:
            kc, vc = k[a:b], v[a:b]
        else:
            blocks = meta.block_tables[s, : -(-ctx // meta.block_size)].long()
            kc, vc = k_cache[blocks].flatten(0, 1)[:ctx], v_cache[blocks].flatten(0, 1)[:ctx]
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q[a:b], kc, vc))
        with sdpa_kernel(ac.PREFILL_SDPA_BACKENDS):
            if ctx == n:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
            else:
                pos = torch.arange(ctx, device=q.device)
                mask = pos[None, :] <= pos[ctx - n :, None]
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out


def attention_flops(heads: int, dim: int, new: int, cached: int) -> float:
    """QK^T and PV of new causal queries over cached + new keys (multiply-adds counted as 2)."""
    return 4.0 * heads * dim * new * (cached + (new + 1) / 2)


def bench_attention(heads, kv_heads, dim, block_size, cases, seed=0) -> list[dict]:
    rows = []
    rng = random.Random(seed)
    for name, cached, new in cases:
        rows.append(_attention_case(heads, kv_heads, dim, block_size, name, cached, new, rng))
        geb.empty_cache()
    return rows


def _attention_case(heads, kv_heads, dim, block_size, name, cached, new, rng) -> dict:
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from token_engine.layers import attention_cuda as ac
    from token_engine.layers.attention import _paged_attention_reference, build_metadata
    from token_engine.layers.attention_prefill_cuda import prefill_attention, prefill_tiles

    ctx = cached + new
    nblk = -(-ctx // block_size)
    pool = torch.randn(nblk + 3, 1, 2, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    table = rng.sample(range(nblk + 3), nblk)
    meta = build_metadata([new], [ctx], [table], block_size, "cuda")
    q = torch.randn(new, heads, dim, device="cuda", dtype=torch.bfloat16)
    blocks = torch.tensor(table, device="cuda").long()
    kc = pool[blocks, 0, 0].flatten(0, 1)[:ctx]
    vc = pool[blocks, 0, 1].flatten(0, 1)[:ctx]
    scale = dim**-0.5
    fresh = cached == 0
    row: dict = {"case": name, "cached": cached, "new": new}
    flops = attention_flops(heads, dim, new, cached)
    row["floor_ms"] = flops / HW["bf16_flops_per_s"] * 1e3

    def paged():
        meta.backend_state.clear()
        return ac.paged_attention(q, pool, 0, meta, scale, None, kc if fresh else None, vc if fresh else None)

    def legacy():
        return legacy_paged_attention(q, pool, 0, meta, scale, None, kc if fresh else None, vc if fresh else None)

    def fa3():
        ac.PREFILL_FA3 = True
        try:
            return paged()
        finally:
            ac.PREFILL_FA3 = False

    def sdpa(backend):
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, kc, vc))

        def run():
            with sdpa_kernel([backend]):
                if fresh:
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
                mask = (torch.arange(ctx, device="cuda")[None, :]
                        <= torch.arange(cached, ctx, device="cuda")[:, None])
                return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return run

    with torch.inference_mode():
        if new * ctx <= 4096 * 24000:
            ref = _paged_attention_reference(q.float(), pool.float(), 0, meta, scale, None)
        else:  # a float32 copy of the scores would be too large: the CPU path's code in bf16
            ref = _paged_attention_reference(q, pool, 0, meta, scale, None).float()
        for label, fn in (("paged", paged), ("legacy", legacy)) + ((("fa3", fa3),) if FA3["ok"] else ()):
            out = fn()
            row[f"{label}_max_abs_err"] = (out.float() - ref).abs().max().item()
            row[f"{label}_ms"] = geb.cuda_time_ms(fn, iters=10, warmup=2)
        for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                               ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                row[f"{label}_ms"] = geb.cuda_time_ms(sdpa(backend), iters=10, warmup=2)
            except RuntimeError as exc:  # no kernel for this shape or mask
                row[f"{label}_ms"] = None
                row[f"{label}_error"] = str(exc).splitlines()[0][:200]
        for config in CONFIGS:  # the paged kernel's tile shapes
            seqs, firsts = prefill_tiles([(0, new)], config[0])
            tiles = torch.tensor([seqs, firsts], dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]

            def tiled(config=config, tiles=tiles, out=out, k_cache=k_cache, v_cache=v_cache):
                return prefill_attention(q, k_cache, v_cache, meta, tiles[0], tiles[1], scale, None, out, config)
            try:
                err = (tiled().float() - ref).abs().max().item()
            except triton.runtime.errors.OutOfResources as exc:  # tiles too large for this card's shared memory
                row.setdefault("configs", []).append({"config": config, "error": str(exc)[:120]})
                continue
            ms = geb.cuda_time_ms(tiled, iters=10, warmup=2)
            row.setdefault("configs", []).append({"config": config, "ms": ms, "max_abs_err": err})
    for key in ("paged", "legacy", "sdpa_flash", "sdpa_cudnn", "fa3"):
        ms = row.get(f"{key}_ms")
        row[f"{key}_tflops"] = flops / (ms / 1e3) / 1e12 if ms else None
    print(json.dumps(row), flush=True)
    return row


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried for head_dim 128; the fastest over the cases becomes the
# kernel's setting for the model-level runs of this process (reported in the JSON).
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3),
           (64, 128, 4, 3), (256, 64, 8, 2), (256, 32, 8, 2)]


def pick_config(rows: list[dict]) -> tuple:
    """The tile shape with the least total time over the cases that have a cached prefix or are long."""
    totals: dict = {}
    counts: dict = {}
    for r in rows:
        for c in r.get("configs", []):
            if c.get("max_abs_err", 1.0) < 0.05:  # ran (fits the card) and is right
                key = tuple(c["config"])
                totals[key] = totals.get(key, 0.0) + c["ms"]
                counts[key] = counts.get(key, 0) + 1
    everywhere = {k: t for k, t in totals.items() if counts[k] == len(rows)}
    return min(everywhere, key=everywhere.get)


def cudnn_first_calls(heads, kv_heads, dim, lengths) -> list[dict]:
    """cuDNN builds a plan per new shape: the first call at each length against the next (plan cached)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for n in lengths:
        q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        rows.append({"tokens": n, "first_ms": times[0], "second_ms": times[1]})
        print(json.dumps({"cudnn": rows[-1]}), flush=True)
    return rows


def model_flops(model, new: int, cached: int) -> float:
    arch = model.arch
    layer_params, head_params = geb.matmul_params(model)
    attn = arch.num_layers * attention_flops(arch.num_heads, arch.head_dim, new, cached)
    return 2.0 * layer_params * new + 2.0 * head_params + attn


def bench_prompt(model, total: int, chunk: int, cached: int, block_size: int, iters: int, seed=0) -> dict:
    """Time to the first token of a prompt of `total` tokens whose first `cached` are already in the pool,
    computed in chunks of `chunk` (0: one step). Returns ms per path and the floor."""
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    nblk = -(-total // block_size)
    pool = allocate_kv_pool(nblk + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            geb.DEVICE)
    pool.normal_()
    table = random.Random(seed).sample(range(nblk + 2), nblk)
    ids = torch.randint(0, arch.vocab_size, (total,), device=geb.DEVICE)
    step = chunk or (total - cached)
    metas = []
    for a in range(cached, total, step):
        b = min(total, a + step)
        metas.append((a, b, build_metadata([b - a], [b], [table], block_size, geb.DEVICE)))

    def run():
        for a, b, meta in metas:
            meta.backend_state.clear()
            hidden = model(ids[a:b], torch.arange(a, b, device=geb.DEVICE), meta, pool)
        model.compute_logits(hidden[-1:])

    row = {"tokens": total, "cached": cached, "chunk": chunk, "steps": len(metas)}
    floor_ms = model_flops(model, total - cached, cached) / HW["bf16_flops_per_s"] * 1e3
    row["floor_ms"] = floor_ms
    paths = [("paged", None)]
    if geb.DEVICE == "cuda":
        paths += [("fresh_sdpa", "fresh_sdpa"), ("fresh_cudnn", "fresh_cudnn"), ("legacy", legacy_paged_attention)]
        if FA3["ok"]:
            paths.append(("fa3", "fa3"))
    ac = None
    if geb.DEVICE == "cuda":
        from token_engine.layers import attention_cuda as ac
    with torch.inference_mode():
        for label, how in paths:
            try:
                if how == "fresh_sdpa":
                    ac.FRESH_PREFILL_SDPA = True
                elif how == "fresh_cudnn":
                    ac.FRESH_PREFILL_CUDNN_MIN = 8192
                elif how == "fa3":
                    ac.PREFILL_FA3 = True
                elif how is not None:
                    original, ac.paged_attention = ac.paged_attention, how
                row[f"{label}_ms"] = geb.cuda_time_ms(run, iters=iters, warmup=1)
                row[f"{label}_x_floor"] = row[f"{label}_ms"] / floor_ms
            finally:
                if ac is not None:
                    ac.FRESH_PREFILL_SDPA = False
                    ac.FRESH_PREFILL_CUDNN_MIN = 0
                    ac.PREFILL_FA3 = False
                    if how is legacy_paged_attention:
                        ac.paged_attention = original
    print(json.dumps(row), flush=True)
    return row


HW = geb.HW
# Whether FA3 loaded in this process (set in main; the attention cases and prompts add an "fa3" path when it did).
FA3: dict = {"ok": False, "why": "not tried"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--chunk", default="8192,2048", help="chunk sizes for the chunked prompt")
    p.add_argument("--agent-cached", type=int, default=20800)
    p.add_argument("--agent-new", type=int, default=1600)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size in tokens (FA3 loads K/V with TMA where it is a multiple of 128)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true",
                   help="decode steps only: no attention kernels, no prompts through the model")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    geb.DEVICE = args.device
    warnings.filterwarnings("ignore", message=".*(kernel not used|disabled|does not support).*")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    HW.update(geb.measure_ceilings())
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({"device": name, **HW}), flush=True)
    result: dict = {"preset": args.preset, "device": name, "torch": torch.__version__, "block_size": args.block_size,
                    "ceilings": dict(HW)}
    if args.device == "cuda":
        from token_engine.layers import attention_fa3

        why = attention_fa3.load()
        FA3.update(ok=why is None, why=why or "loaded", library=attention_fa3.locate()[0])
        result["fa3"] = dict(FA3)
        print(json.dumps({"fa3": FA3}), flush=True)
    t0 = time.perf_counter()
    model, _ = geb.build_random_model(args.preset, seed=0)
    arch = model.arch
    print(f"built {args.preset} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.device == "cuda" and not args.skip_prefill:
        cases = [("agent turn", args.agent_cached, args.agent_new), ("fresh 8k", 0, 8192),
                 (f"fresh {args.prompt}", 0, args.prompt), ("chunk 8k over 24k", 24576, 8192)]
        result["attention"] = bench_attention(arch.num_heads, arch.num_kv_heads, arch.head_dim, args.block_size,
                                              cases)
        from token_engine.layers import attention_prefill_cuda

        best = pick_config(result["attention"])
        attention_prefill_cuda.PREFILL_CONFIG[arch.head_dim] = best
        result["prefill_config"] = best
        print(f"paged prefill tiles for the model runs: {best}", flush=True)
        result["cudnn_first_calls"] = cudnn_first_calls(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                        [30000, 30001, 32768])
    if not args.skip_prefill:
        iters = 3 if args.prompt > 8192 else 5
        prompts = [bench_prompt(model, args.prompt, 0, 0, args.block_size, iters)]
        prompts += [bench_prompt(model, args.prompt, int(c), 0, args.block_size, iters)
                    for c in args.chunk.split(",") if c]
        prompts.append(bench_prompt(model, args.agent_cached + args.agent_new, 0, args.agent_cached, args.block_size,
                                    10))
        result["prompts"] = prompts
    if not args.skip_decode:
        batches = [int(x) for x in args.batches.split(",") if x]
        result["decode"] = geb.bench_decode(model, batches, args.context, args.block_size, args.device == "cuda")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    print_table(result)
    return 0


def _f(x, fmt=".2f"):
    return "-" if x is None else format(x, fmt)


def print_table(result: dict) -> None:
    hw = result["ceilings"]
    print(f"\n{result['preset']} on {result['device']}: HBM {hw['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {hw['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if result.get("attention"):
        print(f"attention, one layer (ms / TFLOP/s / max abs err); tiles for the model runs: "
              f"{result.get('prefill_config')}")
        for r in result["attention"]:
            print("    tiles: " + ", ".join(f"{tuple(c['config'])} {c['ms']:.2f}" if "ms" in c
                                         else f"{tuple(c['config'])} too large" for c in r.get("configs", [])))
            print(f"  {r['case']:>18}: floor {r['floor_ms']:.2f} | paged {_f(r['paged_ms'])} "
                  f"{_f(r['paged_tflops'], '.0f')}"
                  f" err {r['paged_max_abs_err']:.1e} | legacy {_f(r['legacy_ms'])} err {r['legacy_max_abs_err']:.1e}"
                  f" | flash {_f(r['sdpa_flash_ms'])} | cudnn {_f(r['sdpa_cudnn_ms'])} | fa3 {_f(r.get('fa3_ms'))}")
    if result.get("prompts"):
        print("prompts through the model (ms, x floor)")
    for r in result.get("prompts", []):
        parts = [f"{k[:-3]} {r[k]:.1f} ({r[k[:-3] + '_x_floor']:.2f}x)"
                 for k in r if k.endswith("_ms") and k != "floor_ms"]
        print(f"  {r['tokens']:>6} tok, {r['cached']:>6} cached, chunk {r['chunk']:>5}: floor {r['floor_ms']:.1f} | "
              + " | ".join(parts))
    for r in result.get("decode", []):
        print(f"  decode batch {r['batch']:>3}: graph {_f(r['graph_ms'])} ms eager {r['eager_ms']:.2f} ms, floor "
              f"{r['floor_ms']:.2f} ms, {r['x_floor']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
