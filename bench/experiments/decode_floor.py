"""Where a CUDA decode step loses time against the HBM floor, and what takes it back: launch configs of the
few-rows linears (whole K, or split K with the norm after them adding the slices) and of the decode attention.

On a random-weight model of a preset's shape (default Qwen2.5-7B, bf16), in one run on one GPU:

1. the HBM copy bandwidth (the floor's rate, as bench.gpu_engine_bench measures it) and the model;
2. whole decode steps (bench.gpu_engine_bench.bench_decode) with main's settings (no split K, at most 16 rows
   through decode_linear, 64 keys per attention iteration) and with the committed ones;
3. each linear role over all layers' real weights, captured in one graph per variant, at 1 and 32 rows. o and
   down are timed with the add + RMSNorm that consumes their output, since the split-K variants move the sum
   of the K slices into that norm. Variants: cuBLAS, decode_linear per config, decode_linear_split per config
   and slice count. The best per role (summed over the row counts, each relative to cuBLAS) is applied;
4. decode attention over every layer in one graph per (target programs, keys per iteration);
5. whole decode steps with what this run tuned; how far the outputs of main's settings and the committed ones
   are apart; last, per batch and setting, a kernel table of graph-replayed steps plus logits (torch.profiler):
   kernel time summed against the step's time between CUDA events, so launch gaps show as the difference (steps
   timed in a process after the profiler ran came out 0.3-0.4 ms slower, so nothing is timed after it).

    python -m bench.experiments.decode_floor --out $OUT/decode_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.nn import functional as F

import bench.gpu_engine_bench as geb
from bench.experiments.gpu_decode_profile import graph_ms
from bench.portable import portable

PLAIN = [(32, 256, 4, 4), (32, 256, 4, 5), (32, 128, 4, 6), (16, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3),
         # longer K tiles and fewer warps: fewer, larger loads in flight for the small q/k/v and o weights
         (32, 512, 4, 3), (16, 512, 4, 3), (16, 256, 2, 4), (32, 256, 8, 4)]
SPLIT = [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3)]
SLICES = [2, 3, 4, 6, 8]


def _setup(model, batch: int, context: int, block_size: int):
    from token_engine.core.cuda_graphs import DecodeGraphs
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    per_seq = -(-(context + 1) // block_size)
    pool = allocate_kv_pool(batch * per_seq + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                            arch.dtype, "cuda")
    pool.normal_()
    gen = torch.Generator().manual_seed(batch)
    order = torch.randperm(batch * per_seq, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    meta = build_metadata([1] * batch, [context + 1] * batch, tables, block_size, "cuda")
    ids = torch.randint(0, arch.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), context, device="cuda")
    graphs = DecodeGraphs(model, pool, block_size, max_num_seqs=batch, max_blocks_per_seq=per_seq,
                          batch_sizes=[batch])
    graphs.capture()
    return pool, graphs, meta, ids, pos


def kernel_table(model, batch: int, context: int, block_size: int, rows: int = 16, steps: int = 10) -> dict:
    from torch.profiler import ProfilerActivity, profile

    pool, graphs, meta, ids, pos = _setup(model, batch, context, block_size)
    with torch.inference_mode():
        def step():
            model.compute_logits(graphs.replay(ids, pos, meta))

        wall_ms = geb.cuda_time_ms(step, iters=30)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernel_us = sum(e.self_device_time_total for e in events) / steps
    count = sum(e.count for e in events) / steps
    top = [{"kernel": e.key[:80], "calls_per_step": e.count / steps, "us_per_step": e.self_device_time_total / steps}
           for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]]
    print(f"--- batch {batch}: step {wall_ms * 1e3:.0f} us between events, {kernel_us:.0f} us of kernels, "
          f"{count:.0f} kernels, {wall_ms * 1e3 - kernel_us:.0f} us not in kernels", flush=True)
    for r in top:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x  {r['kernel']}", flush=True)
    torch.cuda.empty_cache()
    return {"batch": batch, "wall_us": wall_ms * 1e3, "kernel_us": kernel_us, "kernels": count, "top": top}


def _time_variants(weights, biases, norms, gated: bool, rows: int) -> dict:
    """us per layer of each variant over all the layers' weights, each variant in one graph."""
    from token_engine.layers import blocks_cuda
    from token_engine.layers import decode_linear_cuda as dl

    n_out = weights[0].shape[0] // 2 if gated else weights[0].shape[0]
    x = torch.randn(rows, weights[0].shape[1], device="cuda", dtype=weights[0].dtype)
    r = torch.randn(rows, n_out, device="cuda", dtype=weights[0].dtype)

    def chain(linear):
        def run():
            for i, (w, b) in enumerate(zip(weights, biases)):
                y = linear(w, b)
                if norms is not None:  # the add + RMSNorm that consumes o's and down's output
                    blocks_cuda.rms_norm(y, norms[i].weight, norms[i].eps, r)
        return run

    def cublas(w, b):
        y = F.linear(x, w, b)
        return blocks_cuda.silu_and_mul(y) if gated else y

    variants = {"cublas": chain(cublas)}
    for cfg in PLAIN:
        variants[f"plain {cfg}"] = chain(lambda w, b, cfg=cfg: dl.decode_linear(x, w, b, gated, cfg))
    if norms is not None and biases[0] is None:
        for cfg in SPLIT:
            for s in SLICES:
                variants[f"split {s} {cfg}"] = chain(lambda w, b, cfg=cfg, s=s: dl.decode_linear_split(x, w, s, cfg))
    times: dict = {}
    with torch.inference_mode():
        if norms is not None:
            ms = graph_ms(lambda: [blocks_cuda.rms_norm(r, n.weight, n.eps, r) for n in norms])
            times["norm alone"] = ms * 1e3 / len(norms)
        for name, fn in variants.items():
            try:
                times[name] = graph_ms(fn) * 1e3 / len(weights)
            except Exception as exc:  # noqa: BLE001 - a config over the shared-memory limit, say
                times[name] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
    return times


def sweep_linears(model, rows_list=(1, 32)) -> dict:
    """Per role and row count, us per layer of each variant (o and down with the norm after them); applies the
    best variant per role and padding of the rows."""
    from token_engine.layers import decode_linear_cuda as dl

    layers = list(model.model.layers)
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    roles = {
        "qkv": ([y.self_attn.qkv_proj for y in layers], False, None),
        "o": ([y.self_attn.o_proj for y in layers], False, [y.post_attention_layernorm for y in layers]),
        "gate_up": ([y.mlp.gate_up_proj for y in layers], True, None),
        "down": ([y.mlp.down_proj for y in layers], False, [y.input_layernorm for y in layers]),
        "lm_head": ([head], False, None),
    }
    out: dict = {}
    for role, (mods, gated, norms) in roles.items():
        weights = [m.weight for m in mods]
        biases = [getattr(m, "bias", None) for m in mods]
        n_rows, k_dim = weights[0].shape
        n_out = n_rows // 2 if gated else n_rows
        nbytes = weights[0].numel() * weights[0].element_size()
        role_out: dict = {"n_out": n_out, "k": k_dim, "gated": gated, "rows": {}}
        for rows in rows_list:
            times = _time_variants(weights, biases, norms, gated, rows)
            ok = {k: v for k, v in times.items() if isinstance(v, float) and k != "norm alone"}
            best = min(ok, key=lambda k: ok[k])
            floor_us = nbytes / geb.HW["hbm_bytes_per_s"] * 1e6
            role_out["rows"][rows] = {"us_per_layer": times, "best": best, "floor_us": floor_us}
            print(json.dumps({"role": role, "rows": rows, "floor_us": round(floor_us, 2),
                              "norm_alone_us": times.get("norm alone"), "cublas_us": times["cublas"],
                              "best": best, "best_us": ok[best],
                              "best_plain": min((v, k) for k, v in ok.items() if k.startswith("plain"))}), flush=True)
        role_out["chosen"] = {}
        for rows in rows_list:  # per padding of the rows (16, 32): the best of each
            chosen = role_out["rows"][rows]["best"]
            role_out["chosen"][rows] = chosen
            _apply(dl, n_out, k_dim, gated, 16 if rows <= 16 else 32, chosen)
        print(json.dumps({"role": role, "chosen": role_out["chosen"]}), flush=True)
        out[role] = role_out
    return out


ATTENTION = [(t, n) for t in (264, 528) for n in (64, 128)]  # (TARGET_PROGRAMS, DECODE_BLOCK_N_FEW_SPLITS)


def sweep_attention(model, batches, context: int, block_size: int) -> dict:
    """Decode attention (split-K partial + merge) over every layer in one graph, per (target programs, keys per
    iteration where the context is cut into at most 4 slices); applies the best summed over the batches, each
    relative to the current setting."""
    from token_engine.layers import attention_cuda as ac
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    current = (ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS)
    per_seq = -(-(context + 1) // block_size)
    out: dict = {}
    for batch in batches:
        pool = allocate_kv_pool(batch * per_seq + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                                arch.dtype, "cuda")
        pool.normal_()
        order = torch.randperm(batch * per_seq).tolist()
        meta = build_metadata([1] * batch, [context + 1] * batch,
                              [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)], block_size, "cuda")
        q = torch.randn(batch, arch.num_heads, arch.head_dim, device="cuda", dtype=arch.dtype)

        def run(pool=pool, meta=meta, q=q):
            for layer in range(arch.num_layers):
                ac.decode_attention(q, pool, layer, meta, arch.head_dim**-0.5)

        times = {}
        with torch.inference_mode():
            for setting in ATTENTION:
                ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS = setting
                try:
                    times[str(setting)] = graph_ms(run) * 1e3 / arch.num_layers
                except Exception as exc:  # noqa: BLE001
                    times[str(setting)] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
        ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS = current
        kv_bytes = batch * (context + 1) * arch.kv_bytes_per_token / arch.num_layers
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=lambda k: ok[k])
        out[batch] = {"us_per_layer": times, "floor_us": kv_bytes / geb.HW["hbm_bytes_per_s"] * 1e6, "best": best}
        print(json.dumps({"attention batch": batch, "floor_us": out[batch]["floor_us"],
                          "current_us": times[str(current)], "best": best, "best_us": ok[best]}), flush=True)
        del pool
    totals = {k: sum(out[b]["us_per_layer"][k] / out[b]["us_per_layer"][str(current)] for b in batches)
              for k in out[batches[0]]["us_per_layer"]
              if all(isinstance(out[b]["us_per_layer"][k], float) for b in batches)}
    chosen = min(totals, key=lambda k: totals[k])
    ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS = eval(chosen)  # noqa: S307 - our own repr
    out["chosen"] = chosen
    print(json.dumps({"attention chosen": chosen}), flush=True)
    return out


def _apply(dl, n_out: int, k_dim: int, gated: bool, pad: int, chosen: str) -> None:
    dl.SPLIT_TUNED.pop((n_out, k_dim, pad), None)
    if chosen == "cublas":
        dl.TUNED[(n_out, k_dim, gated, pad)] = None
    elif chosen.startswith("plain"):
        dl.TUNED[(n_out, k_dim, gated, pad)] = eval(chosen.split(" ", 1)[1])  # noqa: S307 - our own repr of a tuple
    else:
        _, slices, cfg = chosen.split(" ", 2)
        dl.SPLIT_TUNED[(n_out, k_dim, pad)] = (eval(cfg), int(slices))  # noqa: S307


def differences(model, batches, context, block_size, settings) -> list[dict]:
    """Hidden states and logits of one eager step under the previous settings against the tuned ones."""
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    per_seq = -(-(context + 1) // block_size)
    rows = []
    for batch in batches:
        pool = allocate_kv_pool(batch * per_seq + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                                arch.dtype, "cuda")
        pool.normal_()
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        meta = build_metadata([1] * batch, [context + 1] * batch, tables, block_size, "cuda")
        ids = torch.randint(0, arch.vocab_size, (batch,), device="cuda")
        pos = torch.full((batch,), context, device="cuda")
        outs = {}
        with torch.inference_mode():
            for name, apply in settings.items():
                apply()
                hidden = model(ids, pos, meta, pool)
                outs[name] = (hidden.float(), model.compute_logits(hidden))
        (h0, l0), (h1, l1) = outs.values()
        rows.append({"batch": batch, "hidden_max_abs_diff": (h0 - h1).abs().max().item(),
                     "hidden_max_abs": h0.abs().max().item(), "logits_max_abs_diff": (l0 - l1).abs().max().item(),
                     "same_argmax_share": (l0.argmax(-1) == l1.argmax(-1)).float().mean().item()})
        print(json.dumps(rows[-1]), flush=True)
        del pool
    return rows


# main's settings before this experiment: whole-K configs for at most 16 rows, no split K, 64 keys per iteration
MAIN_TUNED = {(4608, 3584, False, 16): None, (3584, 3584, False, 16): (32, 128, 4, 6),
              (18944, 3584, True, 16): (32, 256, 4, 5), (3584, 18944, False, 16): (32, 256, 4, 5),
              (152064, 3584, False, 16): (64, 128, 4, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--no-profile", action="store_true", help="no kernel tables (the profiler's part is the slowest)")
    args = p.parse_args(argv)
    from token_engine.layers import attention_cuda as ac
    from token_engine.layers import decode_linear_cuda as dl
    from token_engine.models import llama

    batches = [int(b) for b in args.batches.split(",") if b]
    geb.HW.update(geb.measure_ceilings())
    result: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(), "ceilings": dict(geb.HW)}
    print(json.dumps(result), flush=True)
    model, _ = geb.build_random_model(args.preset, seed=0)
    few_rows = llama.FEW_ROWS

    def settings(linears, splits, rows, attn):
        def apply():
            dl.TUNED.clear()
            dl.TUNED.update(linears)
            dl.SPLIT_TUNED.clear()
            dl.SPLIT_TUNED.update(splits)
            llama.FEW_ROWS = rows
            ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS = attn
        return apply

    previous = settings(MAIN_TUNED, {}, 16, (ac.TARGET_PROGRAMS, 64))
    committed = settings(dict(dl.TUNED), dict(dl.SPLIT_TUNED), few_rows,
                         (ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS))

    def save():
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(portable(result), indent=2))

    def decode(name, apply):
        apply()
        rows = geb.bench_decode(model, batches, args.context, args.block_size, True)
        result.setdefault("decode", {})[name] = rows
        save()

    # the profiler runs last: steps timed after it ran in this process came out slower
    decode("main's settings", previous)
    decode("committed settings", committed)
    t0 = time.perf_counter()
    result["linears"] = sweep_linears(model)
    print(f"[linears: {time.perf_counter() - t0:.1f} s]", flush=True)
    save()
    t0 = time.perf_counter()
    result["attention"] = sweep_attention(model, batches, args.context, args.block_size)
    print(f"[attention: {time.perf_counter() - t0:.1f} s]", flush=True)
    best = settings(dict(dl.TUNED), dict(dl.SPLIT_TUNED), few_rows, (ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS))
    result["tuned"] = {"TUNED": {str(k): v for k, v in dl.TUNED.items()},
                       "SPLIT_TUNED": {str(k): v for k, v in dl.SPLIT_TUNED.items()},
                       "attention": [ac.TARGET_PROGRAMS, ac.DECODE_BLOCK_N_FEW_SPLITS]}
    print(json.dumps(result["tuned"]), flush=True)
    decode("tuned here", best)
    committed()
    result["differences"] = differences(model, batches, args.context, args.block_size,
                                        {"main's settings": previous, "committed": committed})
    if not args.no_profile:
        result["tables_committed"] = [kernel_table(model, b, args.context, args.block_size) for b in batches]
        previous()
        result["tables_main"] = [kernel_table(model, b, args.context, args.block_size) for b in batches]
    save()
    for name, rows in result["decode"].items():
        for r in rows:
            print(f"{name:>20} batch {r['batch']:>3}: {r['graph_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms, "
                  f"{r['x_floor']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
