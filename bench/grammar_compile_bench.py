"""What a structured-outputs compile costs on its way through the engine's compile workers, against the same
compile in-process (the old path: xgrammar on a thread of the engine), in the same run.

    python -m bench.grammar_compile_bench --specs 20 --out $OUT/grammar_compile.json

Each round compiles --specs distinct typical JSON schemas (a tool call's arguments: five typed properties,
an enum, a bounded array; distinct by title, so every one is a cache miss) both ways, alternating, and
times a cache hit (what every later request with the same schema pays). Medians over the specs.
Qwen3's vocabulary (the built-in bundle's tokenizer.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.portable import portable


def schema(i: int) -> dict:
    return {"title": f"call {i}", "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,20}$"}, "maxItems": 5},
    }, "required": ["city", "unit", "days"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import xgrammar
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from render_service.bundle.default_bundle import default_bundle_dir
    from token_engine.structured import GrammarCompiler, parse_structured_outputs
    from token_engine.structured.worker import compile_spec

    model_dir = default_bundle_dir()
    pool = GrammarCompiler(model_dir, 151936, [151645, 151643])
    started = time.perf_counter()
    pool.compile(parse_structured_outputs({"regex": "warm"}))
    first_s = time.perf_counter() - started  # vocabulary + zygote + workers: once per engine
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=151936, stop_token_ids=[151645, 151643])
    inline = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    async def measure() -> tuple[list[float], list[float], list[float]]:
        in_process, workers, hits = [], [], []
        n = 0
        for _ in range(args.rounds):
            for _ in range(args.specs):
                spec = parse_structured_outputs({"json": schema(n), "disable_any_whitespace": True})
                n += 1
                t = time.perf_counter()
                compile_spec(inline, spec)
                in_process.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                await pool.compile_async(spec)
                workers.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                await pool.compile_async(spec)
                hits.append((time.perf_counter() - t) * 1e3)
        return in_process, workers, hits

    in_process, workers, hits = asyncio.run(measure())
    n = len(workers)
    pool.close()
    result = {
        "specs": n, "first_use_s": round(first_s, 2),
        "in_process_ms": round(statistics.median(in_process), 2),
        "worker_ms": round(statistics.median(workers), 2),
        "ratio": round(statistics.median(workers) / statistics.median(in_process), 2),
        "worker_overhead_ms": round(statistics.median(w - i for w, i in zip(workers, in_process)), 2),
        "cache_hit_us": round(statistics.median(hits) * 1e3, 1),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    return result


if __name__ == "__main__":
    main()
