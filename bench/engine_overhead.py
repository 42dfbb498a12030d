"""What the engine adds on top of the model: a full decode step (schedule, inputs, forward, logits, sampling,
bookkeeping) against the model-only step (CUDA-graph replay or eager forward, plus logits) in the same run.

    python -m bench.engine_overhead --preset qwen2.5-7b --batches 1,8,32,128 --context 512 --out $OUT/x.json
    python -m bench.engine_overhead --device cpu --preset tiny --batches 1,4 --context 32     # dry run

Each batch: `batch` requests (greedy unless --temperature) with the same `context`-token prompt (prefix-cached
after the first), stepped until all decode, then timed. Wall clock around synchronized steps (the host work is
the point).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.portable import portable


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device: str, iters: int) -> float:
    samples = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def random_engine(device: str, arch_name: str, preset: str, dtype: str, max_model_len: int, max_batch: int,
                  context: int):
    """(LLMEngine, ModelArch) over a random-weight model of a preset's shape, sized for max_batch sequences
    of max_model_len tokens (all of it in KV blocks on CPU) and a prefill of every prompt in one step."""
    from token_engine.core.engine import EngineConfig, LLMEngine
    from token_engine.models import build_model
    from token_engine.models.arch import arch_from_config, parse_dtype
    from token_engine.models.random_model import random_model_config, randomize_parameters_

    config, generation = random_model_config(arch_name, preset)
    arch = arch_from_config(config, generation, parse_dtype(dtype))
    model = build_model(arch, device)
    randomize_parameters_(model)
    engine = LLMEngine(EngineConfig(
        model=f"random-{preset}", device=device, max_model_len=max_model_len, max_num_seqs=max_batch,
        max_num_batched_tokens=max(8192, context + max_batch),
        num_gpu_blocks_override=None if device == "cuda" else -(-max_model_len * max_batch // 16) + 16,
    ), model=model)
    return engine, arch


def start_decoding(engine, ids: list[str], prompt: list[int], options) -> None:
    """Add one request per id and step until every sequence is decoding, then a few decode steps more."""
    for rid in ids:
        engine.add_request(rid, prompt, options)
    for _ in range(10_000):  # bounded: prefill every sequence, then a few decode steps
        engine.step()
        if not engine.scheduler.waiting and all(
                s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running):
            break
    for _ in range(3):
        engine.step()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from token_engine.core.scheduler import ScheduledSequence
    from token_engine.core.sequence import SamplingOptions

    batches = [int(b) for b in args.batches.split(",")]
    engine, arch = random_engine(args.device, args.arch, args.preset, args.dtype,
                                 args.context + 4 * args.iters + 64, max(batches), args.context)
    runner = engine.runner
    prompt = [(7 * i) % arch.vocab_size for i in range(args.context)]
    greedy = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=10**6,
                             ignore_eos=True)

    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "preset": args.preset,
               "context": args.context, "iters": args.iters, "temperature": args.temperature,
               "top_k": args.top_k, "top_p": args.top_p, "batches": {}}
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        start_decoding(engine, ids, prompt, greedy)
        engine_ms = timed_ms(engine.step, args.device, args.iters)

        # Model only, on the same sequences: forward (graph replay where the runner would use one) + logits.
        running = list(engine.scheduler.running)
        scheduled = [ScheduledSequence(s, 1, True) for s in running]

        def model_only(scheduled=scheduled):
            runner.execute(scheduled)  # writes the same slots each time: the KV values are rewritten unchanged

        model_ms = timed_ms(model_only, args.device, args.iters)
        results["batches"][batch] = {
            "engine_step_ms": round(engine_ms, 3),
            "model_step_ms": round(model_ms, 3),
            "engine_over_model": round(engine_ms / model_ms, 3),
            "cuda_graph": bool(runner.decode_graphs is not None),
        }
        for rid in ids:
            engine.abort_request(rid)
        assert engine.num_free_blocks() == engine.num_blocks
        print(json.dumps({batch: results["batches"][batch]}), flush=True)

    print(f"{'batch':>6} {'engine ms':>10} {'model ms':>9} {'ratio':>6}")
    for batch, r in results["batches"].items():
        print(f"{batch:>6} {r['engine_step_ms']:>10.3f} {r['model_step_ms']:>9.3f} {r['engine_over_model']:>6.3f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(results), indent=2))
    return results


if __name__ == "__main__":
    main()
