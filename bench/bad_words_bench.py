"""What bad_words cost a sampling step: the sampler over one batch of logits with no request banning anything
(the baseline), one request banning, and every request banning, in the same run; ratios against the baseline.

    python -m bench.bad_words_bench --device cuda --batch 64 --out $OUT/bad_words.json
    python -m bench.bad_words_bench --device cpu --batch 16 --iters 20        # dry run

Each banning request carries `--words` bad-word sequences of two tokens whose first tokens were all just
generated (the worst case: every sequence bans its last token this step). The ban list is computed per step
as the engine does (core/bad_words.banned_next_tokens), and counted in the step's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.portable import portable
from token_engine.core.bad_words import banned_next_tokens
from token_engine.core.sampler import Sampler, SamplingRow
from token_engine.core.sequence import SamplingOptions


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_ms(sampler: Sampler, logits: torch.Tensor, options: list[SamplingOptions], output: list[int],
            device: str, iters: int) -> float:
    samples = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        rows = [SamplingRow(o, [], [], None, frozenset(), banned=banned_next_tokens(o.bad_words_token_ids, output, 0)
                            if o.bad_words_token_ids else ()) for o in options]
        sampler(logits, rows)
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--words", type=int, default=64, help="bad-word sequences per banning request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()

    logits = torch.randn(args.batch, args.vocab, device=args.device)
    last = 7
    words = tuple((last, 100 + i) for i in range(args.words))
    plain = SamplingOptions(temperature=args.temperature)
    banning = SamplingOptions(temperature=args.temperature, bad_words_token_ids=words)
    cases = {
        "none": [plain] * args.batch,
        "one": [banning] + [plain] * (args.batch - 1),
        "all": [banning] * args.batch,
    }
    sampler = Sampler()
    for options in cases.values():  # warm-up: allocator, kernels
        step_ms(sampler, logits, options, [last], args.device, 3)
    ms = {name: step_ms(sampler, logits, options, [last], args.device, args.iters) for name, options in cases.items()}
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "batch": args.batch, "vocab": args.vocab, "words": args.words, "temperature": args.temperature,
              "median_ms": ms, "ratio_vs_none": {k: v / ms["none"] for k, v in ms.items()}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))


if __name__ == "__main__":
    main()
