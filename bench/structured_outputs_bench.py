"""What structured outputs cost per decode step: the same batch stepped unconstrained and with a JSON-schema
grammar on every sequence, in the same run, and the ratio of the two.

    python -m bench.structured_outputs_bench --preset qwen2.5-7b --batches 1,8,32,128 --out $OUT/so.json
    python -m bench.structured_outputs_bench --device cpu --preset tiny --dtype float32 --batches 1,4 --iters 10

Random weights, Qwen3's vocabulary (the built-in bundle's tokenizer.json). The grammar is an object with one
free string, so a random model stays inside the string (the grammar state with the most allowed tokens, the
costly case for the mask); `still_constrained` says how many sequences had not closed it when timed.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.engine_overhead import random_engine, start_decoding, timed_ms
from bench.portable import portable

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the two runs this often; medians reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from render_service.bundle.default_bundle import default_bundle_dir
    from token_engine.core.sequence import SamplingOptions
    from token_engine.structured import GrammarCompiler, parse_structured_outputs

    batches = [int(b) for b in args.batches.split(",")]
    engine, arch = random_engine(args.device, args.arch, args.preset, args.dtype,
                                 args.context + 2 * (args.iters + 16) + 64, max(batches), args.context)
    engine.grammars = GrammarCompiler(default_bundle_dir(), arch.vocab_size, sorted(engine.eos_token_ids))
    spec = parse_structured_outputs({"json": SCHEMA})
    free = SamplingOptions(temperature=1.0, seed=0, max_tokens=10**6, ignore_eos=True)
    constrained = SamplingOptions(temperature=1.0, seed=0, max_tokens=10**6, structured=spec,
                                  grammar=engine.grammars.compile(spec), stop_token_ids=frozenset(engine.eos_token_ids))
    prompt = [(7 * i) % 151000 for i in range(args.context)]

    def step_time(batch: int, options: SamplingOptions, tag: str) -> tuple[float, int]:
        ids = [f"{tag}{batch}-{i}" for i in range(batch)]
        start_decoding(engine, ids, prompt, options)
        ms = timed_ms(engine.step, args.device, args.iters)
        still = sum(1 for s in engine.scheduler.running if s.grammar is not None)
        for rid in ids:
            engine.abort_request(rid)
        assert engine.num_free_blocks() == engine.num_blocks
        return ms, still

    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "preset": args.preset,
               "context": args.context, "iters": args.iters, "schema": SCHEMA, "batches": {}}
    for batch in batches:
        free_runs, guided_runs, still = [], [], batch
        for r in range(args.rounds):  # alternated, so a neighbour's load hits both sides alike
            for options, runs in ((free, free_runs), (constrained, guided_runs))[:: 1 if r % 2 == 0 else -1]:
                ms, left = step_time(batch, options, f"r{r}{'g' if options is constrained else 'f'}")
                runs.append(ms)
                if options is constrained:
                    still = min(still, left)
        free_ms, guided_ms = statistics.median(free_runs), statistics.median(guided_runs)
        results["batches"][batch] = {"unconstrained_step_ms": round(free_ms, 3),
                                     "constrained_step_ms": round(guided_ms, 3),
                                     "ratio": round(guided_ms / free_ms, 3), "still_constrained": still}
        print(json.dumps({batch: results["batches"][batch]}), flush=True)

    print(f"{'batch':>6} {'free ms':>9} {'json ms':>9} {'ratio':>6} {'in grammar':>10}")
    for batch, r in results["batches"].items():
        print(f"{batch:>6} {r['unconstrained_step_ms']:>9.3f} {r['constrained_step_ms']:>9.3f} {r['ratio']:>6.3f} "
              f"{r['still_constrained']:>10}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(results), indent=2))
    return results


if __name__ == "__main__":
    main()
