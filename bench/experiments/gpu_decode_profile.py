"""Where a CUDA decode step's time goes, and what the fused small-batch linear kernels buy.

On a random-weight model of a preset's shape (default Qwen2.5-7B, bf16), in one run:

1. ceilings: HBM copy bandwidth (read + write, what gpu_engine_bench's floor uses) and read-only bandwidth;
2. each linear role of the layers (qkv, o, gate_up, down, lm_head) over all layers' real weights, captured in a
   CUDA graph: cuBLAS (F.linear) against decode_linear_cuda with its fusions, for several launch configs, at 1
   and 8 rows; the best config per shape goes into decode_linear_cuda.TUNED for the rest of the run;
3. whole decode steps (CUDA graph replay + logits, as gpu_engine_bench times them) with the fused layer path
   off and on, and the largest difference of the hidden states and logits between the two;
4. a kernel table of one graph-replayed step (torch.profiler) for each path;
5. one mixed prefill + decode step as a loaded server runs it: wall time against kernel time, kernel table,
   and steps whose chunk shape is new each time, with and without cuDNN among the prefill SDPA backends;
6. first-call times of the mixed-step decode attention for 1..N decoding sequences after attention.warm_up_cuda
   (ModelRunner's start-up warm-up): a call that still compiles shows as hundreds of milliseconds.

    python -m bench.experiments.gpu_decode_profile --out bench/results/gpu_decode_profile_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.nn import functional as F

import bench.gpu_engine_bench as engine_bench
from bench.portable import portable

CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (32, 256, 4, 4), (32, 256, 4, 3), (32, 256, 4, 5), (32, 128, 4, 6), (32, 512, 8, 3), (16, 256, 4, 4),
    (16, 512, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3), (64, 64, 4, 8),
]


def graph_ms(fn, iters: int = 20) -> float:
    """Median time of one replay of fn captured in a CUDA graph (no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = engine_bench.cuda_time_ms(graph.replay, iters=iters)
    del graph
    return ms


def read_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.bfloat16, device="cuda").normal_()
    ms = engine_bench.cuda_time_ms(lambda: x.sum(), iters=10)
    nbytes = x.numel() * x.element_size()
    del x
    torch.cuda.empty_cache()
    return nbytes / (ms / 1e3)


def linear_roles(model) -> dict:
    layers = model.model.layers
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    return {
        "qkv": ([l.self_attn.qkv_proj for l in layers], False),
        "o": ([l.self_attn.o_proj for l in layers], False),
        "gate_up": ([l.mlp.gate_up_proj for l in layers], True),  # SiLU(gate) * up folded in
        "down": ([l.mlp.down_proj for l in layers], False),
        "lm_head": ([head], False),
    }


def bench_linears(model, rows_list=(1, 8)) -> dict:
    """Each role over all layers' weights in one graph: cuBLAS (plus silu_and_mul after gate_up, as the
    unfused path has it) against decode_linear per config; the best config per shape (or cuBLAS) goes into
    TUNED."""
    from token_engine.layers import blocks_cuda
    from token_engine.layers import decode_linear_cuda as dl

    out = {}
    for role, (modules, gated) in linear_roles(model).items():
        weights = [m.weight for m in modules]
        biases = [getattr(m, "bias", None) for m in modules]
        n_rows, k_dim = weights[0].shape
        n_out = n_rows // 2 if gated else n_rows
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        role_out = {"n_out": n_out, "k": k_dim, "gated": gated, "layers": len(weights), "rows": {}}
        totals: dict = {}
        for rows in rows_list:
            x = torch.randn(rows, k_dim, device="cuda", dtype=weights[0].dtype)

            def cublas():
                for w, b in zip(weights, biases):
                    y = F.linear(x, w, b)
                    if gated:
                        blocks_cuda.silu_and_mul(y)

            base = graph_ms(cublas)
            entry = {"cublas_us_per_layer": base * 1e3 / len(weights),
                     "cublas_tb_per_s": nbytes / (base / 1e3) / 1e12, "configs": {}}
            totals.setdefault("cublas", []).append(1.0)
            for cfg in CONFIGS:
                def ours():
                    for w, b in zip(weights, biases):
                        dl.decode_linear(x, w, b, gated=gated, config=cfg)

                try:
                    ms = graph_ms(ours)
                except Exception as exc:  # a config over the shared-memory limit, say
                    entry["configs"][str(cfg)] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    continue
                entry["configs"][str(cfg)] = ms * 1e3 / len(weights)
                totals.setdefault(cfg, []).append(ms / base)
            best = min((v, k) for k, v in entry["configs"].items() if isinstance(v, float))
            entry["best_config"], entry["best_us_per_layer"] = best[1], best[0]
            entry["best_tb_per_s"] = nbytes / len(weights) / (best[0] / 1e6) / 1e12
            entry["best_vs_cublas"] = best[0] / entry["cublas_us_per_layer"]
            role_out["rows"][rows] = entry
            print(json.dumps({"role": role, "rows": rows, **{k: v for k, v in entry.items() if k != "configs"}}),
                  flush=True)
        complete = {k: sum(v) for k, v in totals.items() if len(v) == len(rows_list)}
        chosen = min(complete, key=complete.get)  # best over all row counts, each relative to cuBLAS
        for pad in (16, 32):
            dl.TUNED[(n_out, k_dim, gated, pad)] = None if chosen == "cublas" else chosen
        role_out["chosen"] = "cublas" if chosen == "cublas" else list(chosen)
        print(json.dumps({"role": role, "chosen": role_out["chosen"]}), flush=True)
        out[role] = role_out
    return out


def compare_paths(model, batches, context, block_size) -> dict:
    """Decode steps with the fused few-rows path off, then on; and how far apart their outputs are."""
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    result = {}
    for flag in (False, True):
        model.model.few_rows_kernels = flag
        result["fused" if flag else "unfused"] = engine_bench.bench_decode(model, batches, context, block_size, True)
    arch = model.arch
    diffs = []
    blocks_per_seq = -(-(context + 1) // block_size)
    for batch in [b for b in batches if b <= 16]:
        pool = allocate_kv_pool(batch * blocks_per_seq + 2, arch.num_layers, block_size, arch.num_kv_heads,
                                arch.head_dim, arch.dtype, "cuda")
        pool.normal_()
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        meta = build_metadata([1] * batch, [context + 1] * batch, tables, block_size, "cuda")
        ids = torch.randint(0, arch.vocab_size, (batch,), device="cuda")
        pos = torch.full((batch,), context, device="cuda")
        outs = {}
        with torch.inference_mode():
            for flag in (False, True):
                model.model.few_rows_kernels = flag
                hidden = model(ids, pos, meta, pool)
                outs[flag] = (hidden.float(), model.compute_logits(hidden))
        hidden_diff = (outs[True][0] - outs[False][0]).abs().max().item()
        logit_diff = (outs[True][1] - outs[False][1]).abs().max().item()
        same_argmax = bool((outs[True][1].argmax(-1) == outs[False][1].argmax(-1)).all())
        diffs.append({"batch": batch, "hidden_max_abs_diff": hidden_diff,
                      "hidden_max_abs": outs[False][0].abs().max().item(), "logits_max_abs_diff": logit_diff,
                      "same_argmax": same_argmax})
        print(json.dumps(diffs[-1]), flush=True)
        del pool
    model.model.few_rows_kernels = True
    result["differences"] = diffs
    return result


def kernel_table(model, context, block_size, rows: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from token_engine.core.cuda_graphs import DecodeGraphs
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    blocks = -(-(context + 1) // block_size)
    tables = {}
    for flag in (False, True):
        model.model.few_rows_kernels = flag
        pool = allocate_kv_pool(blocks + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                                "cuda")
        graphs = DecodeGraphs(model, pool, block_size, max_num_seqs=1, max_blocks_per_seq=blocks, batch_sizes=[1])
        graphs.capture()
        meta = build_metadata([1], [context + 1], [list(range(blocks))], block_size, "cuda")
        ids = torch.zeros(1, dtype=torch.long, device="cuda")
        pos = torch.full((1,), context, device="cuda")
        for _ in range(3):
            graphs.replay(ids, pos, meta)
        torch.cuda.synchronize()
        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                graphs.replay(ids, pos, meta)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        table = []
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
            table.append({"kernel": e.key[:90], "calls_per_step": e.count / steps,
                          "us_per_step": e.self_device_time_total / steps})
        total = sum(e.self_device_time_total for e in events) / steps
        name = "fused" if flag else "unfused"
        tables[name] = {"kernel_us_per_step": total, "kernels_per_step": sum(e.count for e in events) / steps,
                        "top": table}
        print(f"--- {name}: {total:.0f} us of kernels per step, {tables[name]['kernels_per_step']:.0f} kernels",
              flush=True)
        for row in table:
            print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.1f}x  {row['kernel']}", flush=True)
        del graphs, pool
        torch.cuda.empty_cache()
    model.model.few_rows_kernels = True
    return tables


def attention_first_calls(model, max_seqs: int = 12, context: int = 256, block_size: int = 16) -> list[dict]:
    from token_engine.layers import attention_cuda
    from token_engine.layers.attention import allocate_kv_pool, build_metadata, warm_up_cuda

    arch = model.arch
    blocks = -(-(context + 1) // block_size)
    pool = allocate_kv_pool(blocks * max_seqs + 2, 1, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            "cuda")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(max_seqs)]
    meta = build_metadata([1] * max_seqs, [context + 1] * max_seqs, tables, block_size, "cuda")
    q = torch.randn(max_seqs, arch.num_heads, arch.head_dim, device="cuda", dtype=arch.dtype)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    variants = warm_up_cuda(pool, arch.num_heads, 256, block_size)  # as ModelRunner does at start
    print(json.dumps({"warm_up_variants": variants, "warm_up_s": time.perf_counter() - t0}), flush=True)
    out = []
    for n in range(1, max_seqs + 1):
        ids = torch.arange(n, dtype=torch.int32, device="cuda")
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            attention_cuda.decode_attention(q, pool, 0, meta, arch.head_dim**-0.5, seq_ids=ids)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out.append({"decoding_seqs": n, "splits": attention_cuda.decode_splits(n, arch.num_kv_heads),
                    "first_call_ms": times[0], "second_call_ms": times[1]})
        print(json.dumps(out[-1]), flush=True)
    return out


def mixed_step(model, block_size: int = 16, decodes: int = 62, context: int = 1024) -> dict:
    """One step as a loaded server runs it (2048-token budget): `decodes` sequences decoding at `context`, one
    fresh 1024-token prompt and one 962-token chunk after 1024 cached tokens; eager (mixed steps are not
    graphed), synchronized wall time against the GPU's kernel time of the same step, and its kernel table."""
    from torch.profiler import ProfilerActivity, profile

    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    q_lens = [1] * decodes + [1024, 962]
    seq_lens = [context + 1] * decodes + [1024, 1024 + 962]
    tables, next_block = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    pool = allocate_kv_pool(next_block + 2, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            "cuda")
    pool.normal_()
    positions = [context] * decodes + list(range(1024)) + list(range(1024, 1024 + 962))
    ids = torch.randint(0, arch.vocab_size, (len(positions),), device="cuda")
    pos = torch.tensor(positions, device="cuda")
    result = {"tokens": len(positions), "decodes": decodes}
    with torch.inference_mode():
        def step():
            meta = build_metadata(q_lens, seq_lens, tables, block_size, "cuda")
            hidden = model(ids, pos, meta, pool)
            model.compute_logits(hidden[-(decodes + 2):])

        result["wall_ms"] = engine_bench.cuda_time_ms(step, iters=10, warmup=3)
        # as under load, every step a chunk of another length after another context: a backend that plans
        # per shape pays its planning on each of these (with and without cuDNN among the allowed backends)
        from torch.nn.attention import SDPBackend

        from token_engine.layers import attention_cuda

        chosen = list(attention_cuda.PREFILL_SDPA_BACKENDS)
        for label, backends in (("with_cudnn", [SDPBackend.CUDNN_ATTENTION] + chosen), ("without_cudnn", chosen)):
            attention_cuda.PREFILL_SDPA_BACKENDS = backends
            times = []
            for i in range(6):
                chunk = 900 + 7 * i + (0 if label == "with_cudnn" else 3)  # shapes neither run has seen
                q_lens[-1], seq_lens[-1] = chunk, 1024 + chunk
                n_pos = len(positions) - 962
                step_ids, step_pos = ids[: n_pos + chunk], pos[: n_pos + chunk].clone()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                meta = build_metadata(q_lens, seq_lens, tables, block_size, "cuda")
                model.compute_logits(model(step_ids, step_pos, meta, pool)[-(decodes + 2):])
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            result[f"new_shape_steps_ms_{label}"] = times
            print(json.dumps({f"new_shape_steps_ms_{label}": [round(t, 1) for t in times]}), flush=True)
        attention_cuda.PREFILL_SDPA_BACKENDS = chosen
        q_lens[-1], seq_lens[-1] = 962, 1024 + 962
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        result["kernel_ms"] = sum(e.self_device_time_total for e in events) / 1e3
        result["top"] = [{"kernel": e.key[:90], "calls": e.count, "ms": e.self_device_time_total / 1e3}
                         for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]]
        for row in result["top"]:
            print(f"{row['ms']:8.2f} ms {row['calls']:5d}x  {row['kernel']}", flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "top"}), flush=True)
    del pool
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-7b")
    parser.add_argument("--batches", default="1,8,16,32")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--skip", default="",
                        help="comma list of sections to skip: attention,linears,paths,kernels,mixed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    skip = set(args.skip.split(","))
    torch.manual_seed(0)
    engine_bench.HW.update(engine_bench.measure_ceilings())
    engine_bench.HW["read_bytes_per_s"] = read_bandwidth()
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "ceilings": dict(engine_bench.HW)}
    print(json.dumps(result), flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(portable(result), indent=2))

    model, _ = engine_bench.build_random_model(args.preset, seed=0)
    batches = [int(b) for b in args.batches.split(",") if b]
    sections = [
        ("attention_first_calls", "attention", lambda: attention_first_calls(model)),
        ("linears", "linears", lambda: bench_linears(model)),
        ("decode", "paths", lambda: compare_paths(model, batches, args.context, args.block_size)),
        ("kernels", "kernels", lambda: kernel_table(model, args.context, args.block_size)),
        ("mixed_step", "mixed", lambda: mixed_step(model, args.block_size)),
    ]
    for key, name, fn in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[key] = fn()
        except Exception as exc:  # keep what the other sections measured
            import traceback

            traceback.print_exc()
            result[key] = f"failed: {type(exc).__name__}: {exc}"
        print(f"[{key}: {time.perf_counter() - t0:.1f} s]", flush=True)
        save()
    from token_engine.layers import decode_linear_cuda

    result["tuned"] = {str(k): (list(v) if v else "cublas") for k, v in decode_linear_cuda.TUNED.items()}
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
