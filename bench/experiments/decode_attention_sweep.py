"""Decode attention's launch settings, swept wider than bench.experiments.decode_floor does: how many slices a
sequence's context is cut into, keys per iteration, warps and pipeline stages of the partial kernel.

decode_floor sweeps two program targets and two key counts; at batch 1 both targets hit the 32-slice cap and
at batch 32 both cut the context into 3 or more slices, so fewer slices and other warp and stage counts were
never timed. Here, per batch (default 1 and 32, 1k of context, the preset's head shape, bf16), every layer's
decode attention (partial + merge) is captured in one CUDA graph per setting and replayed:

- batch 1: the slice cap (MAX_SPLITS) 2-32 at the shipped program target;
- larger batches: the program target (TARGET_PROGRAMS) from one slice a (sequence, KV head) up;
- each with keys per iteration 32/64/128, warps 2/4/8, stages 2/3/4 of the kernel class its slice count takes
  (at most 4 slices: the *_FEW_SPLITS settings).

Every setting's output is compared with the shipped settings' (the slices only reorder float32 sums); the
table gives us a layer against the HBM floor of the K/V read. Nothing is applied: the best settings are printed
for attention_cuda's constants.

    python -m bench.experiments.decode_attention_sweep --out $OUT/decode_attention_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

import bench.gpu_engine_bench as geb
from bench.experiments.gpu_decode_profile import graph_ms
from bench.portable import portable

KEYS = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (2, 3, 4)
SLICE_CAPS = (2, 4, 8, 16, 32)  # batch 1
TARGETS_PER_SEQ_HEAD = (1, 2, 3, 4, 6)  # larger batches: programs per (sequence, KV head) the target asks for


def _settings(batch: int, num_kv_heads: int, shipped: dict) -> list[dict]:
    rows = []
    if batch == 1:
        for cap in SLICE_CAPS:
            rows.append({"MAX_SPLITS": cap, "TARGET_PROGRAMS": shipped["TARGET_PROGRAMS"]})
    else:
        for per in TARGETS_PER_SEQ_HEAD:
            rows.append({"MAX_SPLITS": shipped["MAX_SPLITS"], "TARGET_PROGRAMS": per * batch * num_kv_heads})
    out = []
    for base, keys, warps, stages in itertools.product(rows, KEYS, WARPS, STAGES):
        out.append({**base, "keys": keys, "warps": warps, "stages": stages})
    return out


def _apply(ac, setting: dict, num_seqs: int, num_kv_heads: int) -> int:
    """Sets attention_cuda's constants for `setting`; returns the slice count it gives."""
    ac.MAX_SPLITS = setting["MAX_SPLITS"]
    ac.TARGET_PROGRAMS = setting["TARGET_PROGRAMS"]
    splits = ac.decode_splits(num_seqs, num_kv_heads)
    if splits <= 4:
        ac.DECODE_BLOCK_N_FEW_SPLITS = setting["keys"]
        ac.DECODE_WARPS_STAGES_FEW_SPLITS = (setting["warps"], setting["stages"])
    else:
        ac.DECODE_BLOCK_N = setting["keys"]
        ac.DECODE_WARPS_STAGES = (setting["warps"], setting["stages"])
    return splits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from token_engine.layers import attention_cuda as ac
    from token_engine.layers.attention import allocate_kv_pool, build_metadata
    from token_engine.models import arch_from_config
    from token_engine.models.random_model import random_model_config

    names = ("MAX_SPLITS", "TARGET_PROGRAMS", "DECODE_BLOCK_N", "DECODE_BLOCK_N_FEW_SPLITS", "DECODE_WARPS_STAGES",
             "DECODE_WARPS_STAGES_FEW_SPLITS")
    shipped = {name: getattr(ac, name) for name in names}
    config, generation = random_model_config(preset=args.preset, dtype="bfloat16")
    arch = arch_from_config(config, generation)
    geb.HW.update(geb.measure_ceilings())
    result: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(), "ceilings": dict(geb.HW),
                    "context": args.context, "block_size": args.block_size, "shipped": shipped, "batches": {}}
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}), flush=True)
    per_seq = -(-(args.context + 1) // args.block_size)
    for batch in [int(b) for b in args.batches.split(",") if b]:
        torch.manual_seed(batch)
        pool = allocate_kv_pool(batch * per_seq + 2, arch.num_layers, args.block_size, arch.num_kv_heads,
                                arch.head_dim, arch.dtype, "cuda")
        pool.normal_()
        order = torch.randperm(batch * per_seq).tolist()
        meta = build_metadata([1] * batch, [args.context + 1] * batch,
                              [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)], args.block_size, "cuda")
        q = torch.randn(batch, arch.num_heads, arch.head_dim, device="cuda", dtype=arch.dtype)
        outs = torch.empty(arch.num_layers, batch, arch.num_heads, arch.head_dim, device="cuda", dtype=arch.dtype)

        def run(pool=pool, meta=meta, q=q, outs=outs):
            for layer in range(arch.num_layers):
                ac.decode_attention(q, pool, layer, meta, arch.head_dim**-0.5, out=outs[layer])

        rows = []
        with torch.inference_mode():
            for name, value in shipped.items():
                setattr(ac, name, value)
            run()
            reference = outs.clone()
            shipped_us = graph_ms(run) * 1e3 / arch.num_layers
            for setting in _settings(batch, arch.num_kv_heads, shipped):
                for name, value in shipped.items():
                    setattr(ac, name, value)
                splits = _apply(ac, setting, batch, arch.num_kv_heads)
                row = {**setting, "splits": splits}
                try:
                    run()
                    row["max_abs_diff"] = (outs.float() - reference.float()).abs().max().item()
                    row["us_per_layer"] = graph_ms(run) * 1e3 / arch.num_layers
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile here (shared memory)
                    row["failed"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                rows.append(row)
        for name, value in shipped.items():
            setattr(ac, name, value)
        kv_bytes = batch * (args.context + 1) * arch.kv_bytes_per_token / arch.num_layers
        ok = [r for r in rows if "us_per_layer" in r]
        best = min(ok, key=lambda r: r["us_per_layer"])
        result["batches"][str(batch)] = {"floor_us": kv_bytes / geb.HW["hbm_bytes_per_s"] * 1e6,
                                         "shipped_us": shipped_us, "best": best, "settings": rows}
        print(json.dumps({"batch": batch, "floor_us": result["batches"][str(batch)]["floor_us"],
                          "shipped_us": shipped_us, "best": best}), flush=True)
        by_splits: dict[int, dict] = {}
        for r in ok:
            if r["splits"] not in by_splits or r["us_per_layer"] < by_splits[r["splits"]]["us_per_layer"]:
                by_splits[r["splits"]] = r
        for splits, r in sorted(by_splits.items()):
            print(f"  batch {batch:3d} {splits:3d} slices: {r['us_per_layer']:6.2f} us (keys {r['keys']}, warps "
                  f"{r['warps']}, stages {r['stages']}, diff {r['max_abs_diff']:.2g})", flush=True)
        del pool
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
