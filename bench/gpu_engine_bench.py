"""GPU benchmark of the engine's model path: decode step time and prefill time against their floors.

    python -m bench.gpu_engine_bench --preset qwen2.5-7b --batches 1,8,32,128 --context 1024 \
        --prefill 1024,8192 --hf-baseline --out $OUT/gpu_engine_bench.json

What it does, in one process on one GPU:
1. Measures the two ceilings on this card: HBM bandwidth (a large device-to-device copy, bytes read + written)
   and the bf16 matmul rate (8192^3, random data).
2. Builds a random-weight model of the preset's shape directly on the GPU (bf16; no checkpoint file).
3. Decode: for each batch size, every sequence has `context` cached tokens (random K/V in shuffled blocks) and
   one new token. Times eager forward + logits and CUDA-graph replay + logits. Floor: weight bytes read per step
   (every parameter but the embedding table) plus the K/V bytes read, over the measured bandwidth.
4. Prefill: one fresh prompt of each length; times forward + last-token logits. Floor: matmul FLOPs
   (2 * params * tokens, plus causal attention) over the measured matmul rate.
5. Optionally the same measurements for `transformers` eager on a same-shaped random model (the baseline a user
   would reach for), so the speedup is a ratio within one run.
Timings are medians of CUDA-event-timed repetitions after warm-up. Prints a table last; writes JSON.

One device call (repo root; needs only torch, triton, transformers, safetensors, pytest, all in the image):

    set -o pipefail; export PYTHONUNBUFFERED=1
    python3 -m pytest -q -m gpu tests/test_attention.py tests/test_models.py 2>&1 | tee $OUT/gpu_tests.log
    python3 -m bench.gpu_engine_bench --hf-baseline --out $OUT/gpu_engine_bench.json 2>&1 | tee $OUT/bench.log

Dry run of the script's logic on CPU: `python -m bench.gpu_engine_bench --device cpu --preset tiny
--batches 1,4 --context 40 --prefill 64,128`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time

import torch

from bench.portable import portable

DEVICE = "cuda"


def cuda_time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":  # CPU dry run of the script (--device cpu): host clock
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings() -> dict:
    n = 2 * 1024**3 if DEVICE == "cuda" else 64 * 1024**2  # 2 GiB per buffer: far beyond L2
    m = 8192 if DEVICE == "cuda" else 512
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    copy_ms = cuda_time_ms(lambda: dst.copy_(src), iters=10)
    del src, dst
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    mm_ms = cuda_time_ms(lambda: a @ b, iters=10)
    del a, b
    empty_cache()
    return {
        "hbm_bytes_per_s": 2 * n / (copy_ms / 1e3),
        "bf16_flops_per_s": 2 * m**3 / (mm_ms / 1e3),
    }


def empty_cache():
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build_random_model(preset: str, seed: int):
    from token_engine.models import arch_from_config, build_model
    from token_engine.models.random_model import random_model_config, randomize_parameters_

    config, generation = random_model_config(preset=preset, dtype="bfloat16")
    arch = arch_from_config(config, generation)
    model = build_model(arch, DEVICE)
    randomize_parameters_(model, seed)
    return model, config


def weight_bytes(model) -> tuple[int, int]:
    """(all parameter bytes, bytes a decode step reads: all but the embedding table unless it is the head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    read = total if model.lm_head is None else total - embed.numel() * embed.element_size()
    return total, read


def matmul_params(model) -> tuple[int, int]:
    """(parameters in per-token matmuls of the layers, parameters of the LM head)."""
    arch = model.arch
    layer = sum(p.numel() for n, p in model.model.layers.named_parameters() if n.endswith("proj.weight"))
    return layer, arch.vocab_size * arch.hidden_size


def bench_decode(model, batches, context, block_size, use_graphs, seed=0) -> list[dict]:
    from token_engine.core.cuda_graphs import DecodeGraphs
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = max(batches) * blocks_per_seq + 8
    pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype,
                            DEVICE)
    pool.normal_()  # never time on zeros
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(model, pool, block_size, max_num_seqs=max(batches), max_blocks_per_seq=blocks_per_seq,
                              batch_sizes=sorted(set(batches)))
        t0 = time.perf_counter()
        graphs.capture()
        print(f"captured {len(batches)} decode graphs in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(seed)
    _, read_bytes = weight_bytes(model)
    rows = []
    for batch in batches:
        ids = rng.sample(range(num_blocks), batch * blocks_per_seq)
        tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
        meta = build_metadata([1] * batch, [context + 1] * batch, tables, block_size, DEVICE)
        input_ids = torch.randint(0, arch.vocab_size, (batch,), device=DEVICE)
        positions = torch.full((batch,), context, device=DEVICE)

        def eager():
            model.compute_logits(model(input_ids, positions, meta, pool))

        with torch.inference_mode():
            eager_ms = cuda_time_ms(eager)
            graph_ms = None
            if graphs is not None:
                assert graphs.can_replay(meta)
                replayed = graphs.replay(input_ids, positions, meta).clone()
                direct = model(input_ids, positions, meta, pool)
                max_diff = (replayed.float() - direct.float()).abs().max().item()
                assert torch.isfinite(replayed).all(), "non-finite hidden states"
                graph_ms = cuda_time_ms(lambda: model.compute_logits(graphs.replay(input_ids, positions, meta)))
        kv_bytes = batch * (context + 1) * arch.kv_bytes_per_token
        floor_ms = (read_bytes + kv_bytes) / HW["hbm_bytes_per_s"] * 1e3
        weights_floor_ms = read_bytes / HW["hbm_bytes_per_s"] * 1e3
        best = graph_ms if graph_ms is not None else eager_ms
        rows.append({
            "batch": batch, "context": context, "eager_ms": eager_ms, "graph_ms": graph_ms,
            "floor_ms": floor_ms, "weights_only_floor_ms": weights_floor_ms,
            "x_floor": best / floor_ms, "x_weights_floor": best / weights_floor_ms,
            "graph_vs_eager_max_abs_diff": max_diff if graphs is not None else None,
            "tokens_per_s": batch / (best / 1e3),
        })
        print(json.dumps(rows[-1]), flush=True)
    del pool, graphs
    empty_cache()
    return rows


def bench_prefill(model, lengths, block_size, seed=0) -> list[dict]:
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    layer_params, head_params = matmul_params(model)
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        num_blocks = -(-length // block_size) + 4
        pool = allocate_kv_pool(num_blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                                arch.dtype, DEVICE)
        table = rng.sample(range(num_blocks), -(-length // block_size))
        meta = build_metadata([length], [length], [table], block_size, DEVICE)
        input_ids = torch.randint(0, arch.vocab_size, (length,), device=DEVICE)
        positions = torch.arange(length, device=DEVICE)

        def run():
            hidden = model(input_ids, positions, meta, pool)
            model.compute_logits(hidden[-1:])

        with torch.inference_mode():
            ms = cuda_time_ms(run, iters=5 if length > 4096 else 10, warmup=2)
        attn_flops = 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * length  # causal QK^T + PV
        flops = 2 * layer_params * length + 2 * head_params + attn_flops
        floor_ms = flops / HW["bf16_flops_per_s"] * 1e3
        rows.append({"tokens": length, "ms": ms, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                     "tflops_achieved": flops / (ms / 1e3) / 1e12})
        print(json.dumps(rows[-1]), flush=True)
        del pool
        empty_cache()
    return rows


def bench_transformers(config: dict, batches, context, prefill_lengths) -> dict:
    """transformers eager, same shape, random init on the GPU: decode step and prefill."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    out = {"decode": [], "prefill": []}
    with torch.inference_mode():
        for batch in batches:
            prompt = torch.randint(0, cfg.vocab_size, (batch, context), device=DEVICE)
            cache = transformers.DynamicCache(config=cfg)
            model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            step_ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=DEVICE)

            def step():  # the cache grows by one token a step: 13 steps over a 1k context changes little
                model(step_ids, past_key_values=cache, use_cache=True)

            ms = cuda_time_ms(step, iters=10)
            out["decode"].append({"batch": batch, "context": context, "ms": ms})
            print(json.dumps({"transformers_decode": out["decode"][-1]}), flush=True)
            del cache
            empty_cache()
        for length in prefill_lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, length), device=DEVICE)
            ms = cuda_time_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), iters=5, warmup=2)
            out["prefill"].append({"tokens": length, "ms": ms})
            print(json.dumps({"transformers_prefill": out["prefill"][-1]}), flush=True)
    del model
    empty_cache()
    return out


HW: dict = {}


def load_tuned(path: str) -> None:
    import ast

    from token_engine.layers import decode_linear_cuda

    with open(path) as f:
        tuned = json.load(f)
    tuned = tuned.get("tuned", tuned)
    for key, config in tuned.items():
        shape = ast.literal_eval(key)  # (out, in, gated[, rows padded]): without the rows, for both paddings
        for full in [shape] if len(shape) == 4 else [(*shape, 16), (*shape, 32)]:
            decode_linear_cuda.TUNED[full] = None if config == "cublas" else tuple(config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-7b")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence in decode")
    parser.add_argument("--prefill", default="1024,8192")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--hf-baseline", action="store_true")
    parser.add_argument("--hf-batches", default="1,32")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script with --preset tiny")
    parser.add_argument("--tuned", default=None,
                        help="JSON of decode_linear launch configs (the 'tuned' key of gpu_decode_profile's output) "
                             "to use instead of the built-in table")
    args = parser.parse_args(argv)
    if args.tuned:
        load_tuned(args.tuned)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",") if x]
    lengths = [int(x) for x in args.prefill.split(",") if x]
    torch.manual_seed(0)
    HW.update(measure_ceilings())
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(json.dumps({"device": device_name, "torch": torch.__version__, **HW}), flush=True)
    t0 = time.perf_counter()
    model, config = build_random_model(args.preset, seed=0)
    total, read = weight_bytes(model)
    print(f"built {args.preset}: {total / 1e9:.2f} GB of weights ({read / 1e9:.2f} GB read per decode step) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    result = {
        "preset": args.preset, "device": device_name, "torch": torch.__version__,
        "ceilings": HW, "weight_bytes": total, "decode_read_bytes": read, "block_size": args.block_size,
        "decode": bench_decode(model, batches, args.context, args.block_size,
                               DEVICE == "cuda" and not args.no_graphs),
        "prefill": bench_prefill(model, lengths, args.block_size),
    }
    del model
    empty_cache()
    if args.hf_baseline:
        hf_batches = [int(x) for x in args.hf_batches.split(",") if x]
        result["transformers"] = bench_transformers(config, hf_batches, args.context, lengths)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    hw = result["ceilings"]
    print(f"\n{result['preset']} on {result['device']}: HBM {hw['hbm_bytes_per_s'] / 1e12:.2f} TB/s (copy, r+w), "
          f"bf16 matmul {hw['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    hf = {("decode", r["batch"]): r["ms"] for r in result.get("transformers", {}).get("decode", [])}
    hf.update({("prefill", r["tokens"]): r["ms"] for r in result.get("transformers", {}).get("prefill", [])})
    print(f"{'decode batch':>12} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'x floor':>8} {'x w-floor':>9} "
          f"{'hf ms':>8} {'vs hf':>6}")
    for r in result["decode"]:
        g = r["graph_ms"]
        h = hf.get(("decode", r["batch"]))
        best = g if g is not None else r["eager_ms"]
        print(f"{r['batch']:>12} {r['eager_ms']:>9.2f} {(g if g is not None else math.nan):>9.2f} "
              f"{r['floor_ms']:>9.2f} {r['x_floor']:>8.2f} {r['x_weights_floor']:>9.2f} "
              f"{(h if h else math.nan):>8.2f} {(h / best if h else math.nan):>6.1f}")
    print(f"{'prefill tok':>12} {'ms':>9} {'floor ms':>9} {'x floor':>8} {'TFLOP/s':>8} {'hf ms':>8} {'vs hf':>6}")
    for r in result["prefill"]:
        h = hf.get(("prefill", r["tokens"]))
        print(f"{r['tokens']:>12} {r['ms']:>9.1f} {r['floor_ms']:>9.1f} {r['x_floor']:>8.2f} "
              f"{r['tflops_achieved']:>8.0f} {(h if h else math.nan):>8.1f} {(h / r['ms'] if h else math.nan):>6.2f}")


if __name__ == "__main__":
    sys.exit(main())
