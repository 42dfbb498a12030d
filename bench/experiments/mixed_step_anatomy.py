"""What a mixed step costs, and where: decode streams next to a long prompt's chunks, per chunk size and context.

The step budget (token_engine.core.step_budget) picks a chunk size per step from a fitted step-time model. Whether
it can hold 30 ms steps and still finish a 32k prompt near its FLOP floor depends on what a step of `decode +
chunk` tokens really costs as the chunk's context grows. This measures it through LLMEngine.step on a random
model of a preset's shape (default Qwen2.5-7B, bf16), `--streams` decoding:

1. per chunk size, one long prompt prefilled while the streams decode (its chunk capped at that size, the token
   budget one past the step's tokens so that the bucket the step pads to has a graph); per step: its wall time,
   the scheduler's time, the host time inside the runner's `execute`, the GPU time between CUDA events around
   it, whether it replayed a mixed-step graph, the tokens it ran and the context its chunk extended;
2. per chunk size and context quarter: medians of those, the prefill tokens a millisecond, and the step's FLOP
   floor (its chunk over its context plus the decode tokens, at the measured matmul rate), and what the
   scheduler's step-time model fitted from those steps;
3. one step (the middle chunk size, mid-prompt) under torch.profiler: kernel time by kernel name.

    python -m bench.experiments.mixed_step_anatomy --out $OUT/mixed_step_anatomy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import bench.gpu_engine_bench as geb
from bench.long_prompt_bench import model_flops
from bench.long_prompt_interference import make_engine, random_model
from bench.portable import portable


class TimedRunner:
    """Wraps the engine's runner.execute: host time before it, its GPU time, whether a mixed graph replayed."""

    def __init__(self, runner, device: str):
        self.runner, self.device = runner, device
        self.inner = runner.execute
        self.last: dict = {}
        runner.execute = self

    def __call__(self, scheduled):
        cuda = self.device == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        logits = self.inner(scheduled)
        host = time.perf_counter() - t0
        if cuda:
            end.record()
            end.synchronize()
        self.last = {"called_at": t0, "execute_host_ms": host * 1e3,
                     "gpu_ms": start.elapsed_time(end) if cuda else host * 1e3, "tokens": self.runner.last_step_tokens,
                     "graphed": self.runner.last_step_tokens != sum(s.num_new_tokens for s in scheduled)}
        return logits


def run_chunk(model, args, chunk: int, profile_at: int | None) -> dict:
    from token_engine.core.sequence import SamplingOptions
    from token_engine.core.step_budget import PrefillPolicy

    kv_tokens = args.streams * (args.stream_prompt + 2048) + args.long
    # A graph pads a step to a bucket past its last row, and buckets go up to the token budget: the budget is the
    # step's tokens plus one, and the long prompt's chunk is capped at `chunk` (vLLM's long-prefill threshold).
    policy = PrefillPolicy(long_prefill_token_threshold=chunk)
    engine = make_engine(model, args.device, args.streams + 2, args.streams + chunk + 1, args.long + 512, policy,
                         kv_tokens)
    timed = TimedRunner(engine.runner, args.device)
    gen = torch.Generator().manual_seed(0)
    vocab = model.arch.vocab_size
    for i in range(args.streams):
        engine.add_request(f"s{i}", prompt_ids(gen, vocab, args.stream_prompt),
                           SamplingOptions(max_tokens=100_000, ignore_eos=True))
    streams = [engine.requests[f"s{i}"].seqs[0] for i in range(args.streams)]
    while not all(s.num_output_tokens > 0 for s in streams):
        engine.step()
    for _ in range(5):
        engine.step()
    engine.add_request("long", prompt_ids(gen, vocab, args.long), SamplingOptions(max_tokens=1, ignore_eos=True))
    long_seq = engine.requests["long"].seqs[0]
    steps, kernels = [], None
    while long_seq.num_output_tokens == 0:
        context = long_seq.num_computed_tokens
        profiling = profile_at is not None and kernels is None and context >= profile_at
        if profiling:
            kernels = profile_step(engine)
            continue
        t0 = time.perf_counter()
        engine.step()
        wall = (time.perf_counter() - t0) * 1e3
        new = long_seq.num_computed_tokens - context
        called_at = timed.last.pop("called_at")
        steps.append({"context": context, "new": new, "wall_ms": wall, "schedule_ms": (called_at - t0) * 1e3,
                      **timed.last})
    fit = engine.scheduler.step_times.fit_with_pairs()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.shutdown()
    rate = geb.HW["bf16_flops_per_s"]
    quarters = []
    for q in range(4):
        lo, hi = args.long * q // 4, args.long * (q + 1) // 4
        rows = [s for s in steps if lo <= s["context"] < hi and s["new"] == chunk]
        if not rows:
            continue
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("wall_ms", "gpu_ms", "schedule_ms", "execute_host_ms")}
        ctx = statistics.median(r["context"] for r in rows)
        floor = (model_flops(model, chunk, int(ctx)) + model_flops(model, args.streams, args.stream_prompt)) / rate
        quarters.append({"context": [lo, hi], "steps": len(rows), **med,
                         "graphed": sum(r["graphed"] for r in rows) / len(rows),
                         "floor_ms": floor * 1e3, "wall_x_floor": med["wall_ms"] / (floor * 1e3),
                         "prefill_tokens_per_ms": chunk / med["wall_ms"]})
    prefill_ms = sum(s["wall_ms"] for s in steps)
    row = {"chunk": chunk, "steps": len(steps), "long_prefill_ms": prefill_ms,
           "long_x_floor": prefill_ms / (model_flops(model, args.long, 0) / rate * 1e3), "quarters": quarters,
           "fit": dict(zip(("base_ms", "per_token_ms", "per_mpair_ms"), fit)) if fit else None,
           "kernels": kernels, "series": steps[:: max(1, len(steps) // 200)]}
    print(json.dumps({k: v for k, v in row.items() if k not in ("series", "kernels")}), flush=True)
    return row


def prompt_ids(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def profile_step(engine) -> list[dict]:
    """One engine step under torch.profiler: CUDA time per kernel name (ms), longest first, and the total."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name[:90], [0.0, 0])
            t[0] += e.device_time / 1e3
            t[1] += 1
    rows = [{"kernel": k, "ms": v[0], "count": v[1]} for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    print(f"profiled step: kernel time {sum(r['ms'] for r in rows):.2f} ms", flush=True)
    for r in rows[:20]:
        print(f"  {r['ms']:8.3f} ms {r['count']:5d}x  {r['kernel']}", flush=True)
    return rows[:40]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt", type=int, default=1024)
    p.add_argument("--long", type=int, default=32768)
    p.add_argument("--chunks", default="95,223,479,991,2015", help="prefill tokens a step, beside the streams")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = random_model(args.preset, args.device)
    if model is None:
        return 2
    chunks = [int(c) for c in args.chunks.split(",") if c]
    middle = chunks[len(chunks) // 2]
    result = {"preset": args.preset, "device": args.device, "ceilings": dict(geb.HW), "streams": args.streams,
              "long": args.long, "chunks": []}
    for chunk in chunks:
        at = args.long // 2 if chunk == middle and args.device == "cuda" else None
        result["chunks"].append(run_chunk(model, args, chunk, at))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    print(f"\n{args.preset} on {args.device}: {args.streams} decode streams beside one {args.long}-token prompt")
    for r in result["chunks"]:
        for q in r["quarters"]:
            print(f"  chunk {r['chunk']:>5} context {q['context'][0]:>6}+: wall {q['wall_ms']:6.2f} ms "
                  f"(gpu {q['gpu_ms']:6.2f}, schedule {q['schedule_ms']:5.2f}, execute host "
                  f"{q['execute_host_ms']:5.2f}) floor {q['floor_ms']:6.2f} "
                  f"= {q['wall_x_floor']:.2f}x, graphed {q['graphed']:.0%}, {q['prefill_tokens_per_ms']:.0f} tok/ms")
        print(f"  chunk {r['chunk']:>5}: the prompt in {r['long_prefill_ms']:.0f} ms ({r['long_x_floor']:.2f}x its "
              f"floor), fit {r['fit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
