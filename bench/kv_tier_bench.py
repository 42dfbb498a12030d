"""Multi-conversation agent workload whose prefixes exceed the device KV pool: the host offload tier off vs on.

    python -m bench.kv_tier_bench --device cpu --preset tiny --conversations 6 --prefix 512 --turns 3 \
        --pool-tokens 1024 --out bench/results/kv_tier_cpu.json                       # seconds, on CPU
    python -m bench.kv_tier_bench --device cuda --preset qwen2.5-7b --conversations 4 --prefix 32768 --turns 3 \
        --pool-tokens 40960 --out $OUT/kv_tier_h100.json                               # one GPU

Each conversation has its own prefix (--prefix tokens) and grows by --user tokens of "user message" plus the
model's --output tokens per turn; turns go round-robin over the conversations, so with a pool of --pool-tokens
a conversation's prefix is evicted before its next turn. Requests run one at a time (TTFT = the admission plus
prefill steps up to the first token, synchronized). Both modes run on the same random-weight model in one
process; the JSON has per-turn TTFT, prompt tokens computed vs served from a cache tier, the ratio tier-on /
tier-off, and the host tier's load time per block against a bulk host-to-device copy of the same bytes (the
copy floor) measured in the same run: on CUDA both from GPU events (the loads' own events, the floor's around
one bulk copy from a pinned buffer), so `load_vs_floor` is the share of pinned bandwidth the loads reached; on
CPU both are host time. It also counts the copies the loads took (runs of consecutive blocks merge) and the
steps a request spent waiting for its load (the engine steps on meanwhile). A PNG of TTFT per turn goes next
to the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.portable import write_result


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(device: str, arch_name: str, preset: str, dtype: str):
    from token_engine.models import build_model as build
    from token_engine.models.arch import arch_from_config, parse_dtype
    from token_engine.models.random_model import random_model_config, randomize_parameters_

    config, generation = random_model_config(arch_name, preset)
    arch = arch_from_config(config, generation, parse_dtype(dtype))
    model = build(arch, device)
    randomize_parameters_(model)
    return model


def tier_config(tier_bytes: int | None) -> dict | None:
    """vLLM's OffloadingConnector config for a host tier of tier_bytes (None: no tier)."""
    if tier_bytes is None:
        return None
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": tier_bytes}}


def make_engine(model, args, tier_bytes: int | None):
    from token_engine.core.engine import EngineConfig, LLMEngine

    max_len = args.prefix + args.turns * (args.user + args.output) + 16
    return LLMEngine(EngineConfig(
        model=f"random-{args.preset}", device=args.device, max_model_len=max_len, max_num_seqs=4,
        max_num_batched_tokens=args.chunk, block_size=16, num_gpu_blocks_override=-(-args.pool_tokens // 16),
        enforce_eager=True, kv_transfer_config=tier_config(tier_bytes),
    ), model=model)


def run_workload(engine, args, vocab: int) -> list[dict]:
    from token_engine.core.sequence import SamplingOptions

    g = torch.Generator().manual_seed(0)
    convs = [torch.randint(10, vocab - 10, (args.prefix,), generator=g).tolist() for _ in range(args.conversations)]
    options = SamplingOptions(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    rows = []
    for turn in range(args.turns):
        for c, history in enumerate(convs):
            history.extend(torch.randint(10, vocab - 10, (args.user,), generator=g).tolist())
            out: list[int] = []
            first: list[float] = []
            cached: list[int] = []

            def on_update(u, out=out, first=first, cached=cached):
                if not first and any(d.token_ids for d in u.deltas):
                    sync(args.device)
                    first.append(time.perf_counter())
                out.extend(t for d in u.deltas for t in d.token_ids)
                cached.append(u.num_cached_tokens)

            sync(args.device)
            t0 = time.perf_counter()
            engine.add_request(f"c{c}-t{turn}", list(history), options, on_update=on_update)
            waiting_steps = 0  # steps that found the request waiting for its KV load (a host-tier hit)
            while engine.has_work():
                waiting_steps += bool(engine.scheduler.waiting_for_remote)
                engine.step()
            rows.append({"turn": turn, "conversation": c, "prompt_tokens": len(history),
                         "cached_tokens": cached[-1], "ttft_s": first[0] - t0, "load_wait_steps": waiting_steps})
            history.extend(out)
    return rows


def copy_floor_s_per_block(engine) -> float:
    """One bulk copy of 64 blocks' bytes from a host buffer into the device pool, per block, best of 5: on CUDA
    from a pinned buffer, timed by GPU events (as the tier times its loads); on CPU by the host clock."""
    pool = engine.runner.kv_pool
    n = min(64, pool.shape[0])
    cuda = pool.device.type == "cuda"
    src = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, pin_memory=cuda)
    best = float("inf")
    for _ in range(5):
        sync(engine.config.device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pool[:n].copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            pool[:n].copy_(src)
            dt = time.perf_counter() - t0
        best = min(best, dt / n)
    return best


def decode_steps(model, args, tier_bytes: int | None) -> dict:
    """Decode steps while evictions offload blocks: a pool filled with cached prefixes, then --streams streams
    decoding; every block a stream starts evicts a cached one, which the tier (when on) copies to host memory.
    Step times (synchronized) of steps that evicted and of steps that did not, CUDA graphs on as in serving."""
    from token_engine.core.engine import EngineConfig, LLMEngine
    from token_engine.core.sequence import SamplingOptions

    pool_tokens = args.decode_pool_tokens
    engine = LLMEngine(EngineConfig(
        model=f"random-{args.preset}", device=args.device, max_model_len=pool_tokens, max_num_seqs=args.streams,
        max_num_batched_tokens=max(2048, args.streams), block_size=16,
        num_gpu_blocks_override=pool_tokens // 16, kv_transfer_config=tier_config(tier_bytes),
    ), model=model)
    g = torch.Generator().manual_seed(1)
    vocab = model.arch.vocab_size
    filler = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
    fill_len = max(16, min(1024, pool_tokens // 8))
    for i in range(pool_tokens * 9 // 10 // fill_len):  # finished prompts leave their blocks cached
        engine.add_request(f"fill{i}", torch.randint(10, vocab - 10, (fill_len,), generator=g).tolist(), filler)
        while engine.has_work():
            engine.step()
    options = SamplingOptions(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", torch.randint(10, vocab - 10, (16,), generator=g).tolist(), options)
    engine.step()  # the streams' prompts
    evicting, plain = [], []
    seqs = [s for st in engine.requests.values() for s in st.seqs]
    while engine.has_work():
        blocks = sum(len(s.block_table) for s in seqs)
        sync(args.device)
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        ms = (time.perf_counter() - t0) * 1e3
        # a step that gave a stream a new block evicted a cached one (and, tier on, offloaded it)
        (evicting if sum(len(s.block_table) for s in seqs) > blocks else plain).append(ms)
    tier = engine.host_tier
    engine.shutdown()

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"steps": len(xs), "mean_ms": statistics.fmean(xs) if xs else None,
                "median_ms": statistics.median(xs) if xs else None,
                "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None}

    return {"steps_with_new_blocks": stats(evicting), "other_steps": stats(plain),
            "offloaded_blocks": tier.stored_blocks if tier is not None else 0,
            # the host's time to issue the offloads (on CUDA they run asynchronously), per block
            "offload_issue_s_per_block": tier.store_seconds / tier.stored_blocks
            if tier is not None and tier.stored_blocks else None}


def summarize(rows: list[dict]) -> dict:
    turns = sorted({r["turn"] for r in rows})
    return {
        "median_ttft_s_by_turn": [statistics.median(r["ttft_s"] for r in rows if r["turn"] == t) for t in turns],
        "sum_ttft_s_after_first_turn": sum(r["ttft_s"] for r in rows if r["turn"] > 0),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "prompt_tokens_cached": sum(r["cached_tokens"] for r in rows),
        "prompt_tokens_computed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user", type=int, default=64, help="new prompt tokens per turn")
    ap.add_argument("--output", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--pool-tokens", type=int, default=40960, help="device KV pool size, in tokens")
    ap.add_argument("--tier-gib", type=float, default=None, help="host tier size (default: every prefix fits)")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--streams", type=int, default=32, help="decode streams of the decode-step part (0: skip)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens each decode stream generates")
    ap.add_argument("--decode-pool-tokens", type=int, default=16384, help="device KV pool of the decode-step part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")

    from token_engine.core.model_runner import kv_block_bytes

    model = build_model(args.device, args.arch, args.preset, dtype)
    total_tokens = args.conversations * (args.prefix + args.turns * (args.user + args.output))
    tier_bytes = (int(args.tier_gib * (1 << 30)) if args.tier_gib
                  else (total_tokens // 16 + 64) * kv_block_bytes(model.arch, 16))
    result: dict = {"args": vars(args), "dtype": dtype, "device_name": torch.cuda.get_device_name()
                    if args.device == "cuda" else "cpu", "tier_bytes": tier_bytes,
                    "block_bytes": kv_block_bytes(model.arch, 16)}
    for mode, size in (("tier_off", None), ("tier_on", tier_bytes)):
        engine = make_engine(model, args, size)
        rows = run_workload(engine, args, model.arch.vocab_size)
        result[mode] = {"rows": rows, **summarize(rows)}
        tier = engine.host_tier
        if tier is not None:
            floor = copy_floor_s_per_block(engine)
            sync(args.device)
            # on CUDA the loads' own time on the GPU (events); on CPU copies are synchronous: the host's time
            per_block = tier.load_time / tier.loaded_blocks if tier.loaded_blocks else None
            result[mode]["tier"] = {
                "loaded_blocks": tier.loaded_blocks, "stored_blocks": tier.stored_blocks,
                "load_copies": tier.load_copies, "load_wait_steps": sum(r["load_wait_steps"] for r in rows),
                "load_issue_s_per_block": tier.load_seconds / tier.loaded_blocks if tier.loaded_blocks else None,
                "load_s_per_block": per_block, "store_s_per_block":
                    tier.store_seconds / tier.stored_blocks if tier.stored_blocks else None,
                "copy_floor_s_per_block": floor,
                "load_vs_floor": floor / per_block if floor and per_block else None,
                "load_gb_per_s": tier.block_bytes / per_block / 1e9 if per_block else None}
            result[mode]["free_blocks_after"] = engine.num_free_blocks()
            result[mode]["num_blocks"] = engine.num_blocks
        engine.shutdown()
        del engine
    if args.streams:
        result["decode_steps"] = {mode: decode_steps(model, args, size)
                                  for mode, size in (("tier_off", None), ("tier_on", tier_bytes))}
        off_d, on_d = (result["decode_steps"][m]["steps_with_new_blocks"]["mean_ms"] for m in ("tier_off", "tier_on"))
        result["decode_steps"]["slowdown_of_evicting_steps"] = on_d / off_d - 1 if off_d and on_d else None
    off, on = result["tier_off"], result["tier_on"]
    result["ttft_ratio_off_over_on_after_first_turn"] = (
        off["sum_ttft_s_after_first_turn"] / on["sum_ttft_s_after_first_turn"])
    result["computed_ratio_on_over_off"] = on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, result)
        plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("tier_off", "tier_on")} | {
        m: {k: v for k, v in result[m].items() if k != "rows"} for m in ("tier_off", "tier_on")}, indent=2))
    return result


def plot(result: dict, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("tier_off", "tier_on"):
        ys = result[mode]["median_ttft_s_by_turn"]
        ax.plot(range(len(ys)), ys, marker="o", label=mode.replace("_", " "))
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"{result['args']['conversations']} conversations, {result['args']['prefix']}-token prefixes, "
                 f"{result['device_name']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
