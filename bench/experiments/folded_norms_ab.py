"""Decode steps with the add + RMSNorm folded into the linears around it, against the norm kernels, in one process.

A decode step of a 7B model launches two norm kernels a layer (after o and after down), each a few microseconds
of launch and latency for a few kilobytes of work. With the norms folded (`LlamaModel.fold_norms`), o and down
add the residual and leave their rows' partial sums of squares, and q/k/v and gate_up normalise their input
with them (decode_linear_cuda.decode_linear_residual, RowNorm). This times whole graph-replayed decode steps
(bench.gpu_engine_bench.bench_decode: 1k of context, random Qwen2.5-7B shape, bf16) with the norms folded and
with the norm kernels, alternating (folded, kernels, kernels, folded, ...) so drift on the card falls on both,
and compares the two paths' logits on the same inputs.

    python -m bench.experiments.folded_norms_ab --out $OUT/folded_norms_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import bench.gpu_engine_bench as geb
from bench.portable import portable


def logits_apart(model, batch: int, context: int, block_size: int) -> dict:
    """Both paths on the same step: the largest logit difference and how many rows pick the same token."""
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    arch = model.arch
    blocks = -(-(context + 1) // block_size)
    pool = allocate_kv_pool(batch * blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim,
                            arch.dtype, geb.DEVICE)
    pool.normal_()
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    meta = build_metadata([1] * batch, [context + 1] * batch, tables, block_size, geb.DEVICE)
    ids = torch.randint(0, arch.vocab_size, (batch,), device=geb.DEVICE)
    positions = torch.full((batch,), context, device=geb.DEVICE)
    out = {}
    with torch.inference_mode():
        for folded in (True, False):
            model.model.fold_norms = folded
            out[folded] = model.compute_logits(model(ids, positions, meta, pool.clone()))
    model.model.fold_norms = True
    return {"batch": batch, "max_abs_diff": (out[True] - out[False]).abs().max().item(),
            "same_argmax": int((out[True].argmax(-1) == out[False].argmax(-1)).sum()),
            "logit_scale": out[False].abs().max().item()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="pairs of runs; each pair's order alternates")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    geb.HW.update(geb.measure_ceilings())
    name = torch.cuda.get_device_name()
    print(json.dumps({"device": name, **geb.HW}), flush=True)
    model, _ = geb.build_random_model(args.preset, seed=0)
    model.eval()
    runs: list[dict] = []
    for r in range(args.rounds):
        for folded in ((True, False) if r % 2 == 0 else (False, True)):
            model.model.fold_norms = folded
            for row in geb.bench_decode(model, batches, args.context, args.block_size, use_graphs=True):
                runs.append({"folded": folded, "round": r, **row})
    model.model.fold_norms = True
    apart = [logits_apart(model, b, args.context, args.block_size) for b in batches]
    summary = {}
    for b in batches:
        for folded in (True, False):
            ms = [x["graph_ms"] for x in runs if x["batch"] == b and x["folded"] == folded]
            ratio = [x["x_floor"] for x in runs if x["batch"] == b and x["folded"] == folded]
            summary[f"batch {b}, {'folded' if folded else 'norm kernels'}"] = {
                "graph_ms": ms, "median_ms": statistics.median(ms), "median_x_floor": statistics.median(ratio)}
    result = {"preset": args.preset, "device": name, "context": args.context, "block_size": args.block_size,
              "ceilings": dict(geb.HW), "runs": runs, "logits_apart": apart, "summary": summary}
    print(f"\n{args.preset} on {name}: HBM {geb.HW['hbm_bytes_per_s'] / 1e12:.2f} TB/s")
    for key, row in summary.items():
        print(f"  {key:28s} median {row['median_ms']:.3f} ms ({row['median_x_floor']:.3f}x floor); "
              + ", ".join(f"{ms:.3f}" for ms in row["graph_ms"]))
    for row in apart:
        print(f"  logits, batch {row['batch']}: max abs diff {row['max_abs_diff']:.3g} of {row['logit_scale']:.3g}, "
              f"same argmax {row['same_argmax']}/{row['batch']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(portable(result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
