"""Long prompts against a running engine: decode streams' inter-token gaps while a long prompt is prefilled,
and agent turns over a growing cached conversation. In one process, through LLMEngine.step (no HTTP).

    python -m bench.long_prompt_interference --preset qwen2.5-7b --out $OUT/interference.json --plot $OUT/itl.png

Interference: `--streams` short requests decode; once they are all decoding, one `--long`-token prompt
arrives, and while it is being prefilled `--shorts` short prompts arrive one by one. Per scheduling mode
(plain chunking at each --chunk; the step budget of --target-step-ms with --long-prefill-token-threshold,
planned with each of --budget-plans: the bucket times the engine measures at start-up, or the step-time fit):
the streams' inter-token gaps (p50/p99/max) before, during and after the long prefill, the long prompt's
time to first token against its FLOP floor, and the TTFT of the shorts that arrived meanwhile.
Agent turns: one conversation grows by --agent-new tokens a turn (the previous turn's output stays in the
prompt); with prefix caching each turn computes only its new tokens. TTFT per turn against the FLOP floor of
those new tokens over the cached prefix. The floor's rate is the bf16 matmul rate measured in the same run.

Dry run on CPU: `--device cpu --preset tiny --streams 4 --long 600 --shorts 2 --chunk 128 --target-step-ms 0
--agent-turns 3 --agent-new 64`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from bench import gpu_engine_bench as geb
from bench.long_prompt_bench import model_flops
from bench.portable import portable


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def summary(gaps: list[float]) -> dict:
    return {"n": len(gaps), "p50_ms": pct(gaps, 0.5), "p99_ms": pct(gaps, 0.99), "max_ms": max(gaps, default=None)}


def make_engine(model, device: str, max_num_seqs: int, budget: int, max_model_len: int, policy, kv_tokens: int,
                block_size: int = 16):
    """An engine over the shared model with a KV pool of kv_tokens in blocks of block_size tokens (several
    engines, one after another)."""
    from token_engine.core.engine import EngineConfig, LLMEngine

    gc.unfreeze()  # what the previous engine froze goes back to the collector, its pool first
    gc.collect()
    geb.empty_cache()
    engine = LLMEngine(EngineConfig(model="random", device=device, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                    prefill_policy=policy, block_size=block_size,
                                    num_gpu_blocks_override=-(-kv_tokens // block_size) + 64),
                       model=model)
    gc.freeze()  # as the engine's server does once it is built
    return engine


class CollectorPauses:
    """The garbage collector's passes while `on`: (generation, ms) each, through gc.callbacks."""

    def __init__(self):
        self.on = False
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._started) * 1e3))

    def summary(self) -> dict:
        return {f"generation {g}": {"n": len(ms), "max_ms": max(ms)}
                for g in (0, 1, 2) if (ms := [t for gen, t in self.pauses if gen == g])}


def _ms(value: float | None) -> str:
    """A gap figure for the summary line ("-": none, as in a run without streams)."""
    return "-" if value is None else f"{value:.1f}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interference(model, args, label: str, budget: int, policy, plan: str = "buckets") -> dict:
    """One scheduling mode; `plan`: what the step budget plans with, the measured bucket times (the engine's
    choice where mixed steps replay graphs) or the step-time fit alone (`fit`)."""
    from token_engine.core.sequence import SamplingOptions

    vocab = model.arch.vocab_size
    kv_tokens = args.streams * (args.stream_prompt + 4096) + args.long + args.shorts * args.short_prompt
    engine = make_engine(model, args.device, args.streams + args.shorts + 2, budget, args.long + 512, policy,
                         kv_tokens, args.block_size)
    if plan == "fit":
        engine.scheduler.bucket_times = None
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    stream_ids = [f"s{i}" for i in range(args.streams)]
    for rid in stream_ids:
        engine.add_request(rid, prompt(args.stream_prompt), SamplingOptions(max_tokens=100_000, ignore_eos=True))
    seqs = {rid: engine.requests[rid].seqs[0] for rid in stream_ids}
    last: dict[str, tuple[int, float]] = {}
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    phase = "before"
    long_start = long_first = None
    shorts: dict[str, float] = {}
    short_ttft: dict[str, float] = {}
    steps_after = 0
    steps_during: list[tuple[int, int, float]] = []  # (tokens the step ran, the long prompt's context, ms)
    collector = CollectorPauses()
    long_seq = None
    gc.callbacks.append(collector)
    # "before" counts gaps from the step after every stream has its first token: until then steps hold the
    # streams' own prefill (a stream whose prompt finished a step early would count that step as a gap)
    decoding = False
    while True:
        began = time.perf_counter()
        context = long_seq.num_computed_tokens if long_seq is not None and phase == "during" else 0
        engine.step()
        now = time.perf_counter()
        if phase == "during":
            steps_during.append((engine.runner.last_step_tokens, context, round((now - began) * 1e3, 3)))
        counted = decoding
        decoding = decoding or all(seq.num_output_tokens > 0 for seq in seqs.values())
        for rid, seq in seqs.items():
            n = seq.num_output_tokens
            if rid in last and n > last[rid][0] and (counted or phase != "before"):
                phases[phase].append((now - last[rid][1]) * 1e3 / (n - last[rid][0]))
            if rid not in last or n > last[rid][0]:
                last[rid] = (n, now)
        if phase == "before" and len(phases["before"]) >= args.streams * args.warm_steps:
            phase = "during"
            sync(args.device)
            long_start = time.perf_counter()
            engine.add_request("long", prompt(args.long), SamplingOptions(max_tokens=1, ignore_eos=True))
            long_seq = engine.requests["long"].seqs[0]
            collector.on = True
        if phase == "during":
            # shorts arrive one per step at first, while the long prompt is still being prefilled
            if len(shorts) < args.shorts and long_seq.num_output_tokens == 0:
                rid = f"short{len(shorts)}"
                shorts[rid] = time.perf_counter()
                engine.add_request(rid, prompt(args.short_prompt), SamplingOptions(max_tokens=1, ignore_eos=True))
            for rid, t0 in shorts.items():
                state = engine.requests.get(rid)
                done = state is None or state.seqs[0].num_output_tokens > 0
                if rid not in short_ttft and done:
                    short_ttft[rid] = (now - t0) * 1e3
            if long_first is None and ("long" not in engine.requests or long_seq.num_output_tokens > 0):
                long_first = now
                phase = "after"
                collector.on = False
        elif phase == "after":
            steps_after += 1
            if steps_after >= args.warm_steps:
                break
    gc.callbacks.remove(collector)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    mixed = engine.runner.mixed_graphs
    bucket_times = engine.scheduler.bucket_times
    engine.shutdown()
    floor_ms = model_flops(model, args.long, 0) / geb.HW["bf16_flops_per_s"] * 1e3
    ttft = (long_first - long_start) * 1e3
    row = {"mode": label, "budget": budget, "policy": policy.__dict__ if policy else None,
           "long_tokens": args.long, "long_ttft_ms": ttft, "long_floor_ms": floor_ms, "long_x_floor": ttft / floor_ms,
           "itl": {k: summary(v) for k, v in phases.items()},
           "short_ttft_ms": summary(list(short_ttft.values())), "shorts_answered": len(short_ttft),
           "mixed_step_graphs": len(mixed.graphs) if mixed is not None else 0,
           "budget_plan": plan if policy is not None and policy.target_step_ms > 0 else None,
           "steps_during": steps_during,
           "collector_pauses_during": collector.summary(),
           "bucket_times": ({b: [round(ms, 3), round(per_k, 4)] for b, (ms, per_k) in bucket_times.measured.items()}
                            if bucket_times is not None else None),
           "bucket_extra_ms": bucket_times.extra_ms if bucket_times is not None else None,
           "itl_during_series_ms": phases["during"][:: max(1, len(phases["during"]) // 400)]}
    print(json.dumps({k: v for k, v in row.items() if k not in ("itl_during_series_ms", "steps_during")}), flush=True)
    return row


def agent_turns(model, args) -> list[dict]:
    from token_engine.core.sequence import SamplingOptions

    total = args.agent_turns * (args.agent_new + args.agent_output) + 512
    engine = make_engine(model, args.device, 4, max(8192, args.agent_new + 16), total, None, 2 * total,
                         args.block_size)
    gen = torch.Generator().manual_seed(1)
    history: list[int] = []
    rows = []
    for turn in range(args.agent_turns):
        history += torch.randint(0, model.arch.vocab_size, (args.agent_new,), generator=gen).tolist()
        rid = f"turn{turn}"
        sync(args.device)
        t0 = time.perf_counter()
        state = engine.add_request(rid, list(history), SamplingOptions(max_tokens=args.agent_output, ignore_eos=True))
        seq = state.seqs[0]
        first = None
        while rid in engine.requests and not seq.is_finished:
            engine.step()
            if first is None and seq.num_output_tokens > 0:
                first = time.perf_counter()
        history += seq.token_ids[len(history):]
        cached = seq.num_cached_tokens
        new = len(seq.prompt_token_ids) - cached
        floor_ms = model_flops(model, new, cached) / geb.HW["bf16_flops_per_s"] * 1e3
        ttft = (first - t0) * 1e3
        rows.append({"turn": turn, "prompt": len(seq.prompt_token_ids), "cached": cached, "new": new,
                     "ttft_ms": ttft, "floor_ms": floor_ms, "x_floor": ttft / floor_ms})
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for row in result["interference"]:
        a.plot(row["itl_during_series_ms"], label=f"{row['mode']} (TTFT {row['long_ttft_ms']:.0f} ms)")
    a.set_yscale("log")
    a.set_xlabel("token gaps of the decode streams while the long prompt is prefilled")
    a.set_ylabel("inter-token gap (ms)")
    a.legend(fontsize=7)
    turns = result["agent_turns"]
    b.plot([r["cached"] for r in turns], [r["ttft_ms"] for r in turns], "o-", label="TTFT")
    b.plot([r["cached"] for r in turns], [r["floor_ms"] for r in turns], "x--", label="floor of the new tokens")
    b.set_xlabel("cached prefix (tokens)")
    b.set_ylabel("ms")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def random_model(preset: str, device: str):
    """A random-weight model of the preset on the device, with this card's ceilings measured into geb.HW first
    (the floors' rates); None, said on stderr, where CUDA is asked for and absent."""
    geb.DEVICE = device
    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    torch.manual_seed(0)
    geb.HW.update(geb.measure_ceilings())
    model, _ = geb.build_random_model(preset, seed=0)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt", type=int, default=1024)
    p.add_argument("--long", type=int, default=32768)
    p.add_argument("--shorts", type=int, default=4)
    p.add_argument("--short-prompt", type=int, default=256)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--chunk", default="8192,2048", help="plain chunked prefill at these budgets")
    p.add_argument("--target-step-ms", default="25,40", help="step-budget targets (ms); 0 or empty: none")
    p.add_argument("--long-prefill-token-threshold", type=int, default=2048,
                   help="with the step budget: prompts longer than this fill what shorter ones leave")
    p.add_argument("--budget", type=int, default=16384, help="max-num-batched-tokens with the step budget")
    p.add_argument("--budget-plans", default="buckets",
                   help="what the step budget plans with, one run each: buckets (measured at start-up), fit")
    p.add_argument("--agent-turns", type=int, default=12)
    p.add_argument("--agent-new", type=int, default=1600)
    p.add_argument("--agent-output", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size in tokens (FA3 reads the pool with TMA where it is a multiple of 128)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    from token_engine.core.step_budget import PrefillPolicy

    model = random_model(args.preset, args.device)
    if model is None:
        return 2
    result: dict = {"preset": args.preset, "device": args.device, "block_size": args.block_size,
                    "ceilings": dict(geb.HW), "interference": []}
    for chunk in [int(c) for c in args.chunk.split(",") if c]:
        result["interference"].append(interference(model, args, f"chunk {chunk}", chunk, PrefillPolicy()))
    for target in [float(t) for t in args.target_step_ms.split(",") if t and float(t) > 0]:
        policy = PrefillPolicy(target_step_ms=target, long_prefill_token_threshold=args.long_prefill_token_threshold)
        for plan in [p for p in args.budget_plans.split(",") if p]:
            result["interference"].append(interference(model, args, f"step budget {target:g} ms, {plan}",
                                                       args.budget, policy, plan))
    result["agent_turns"] = agent_turns(model, args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(portable(result), indent=2))
    if args.plot:
        plot(result, args.plot)
    print(f"\n{args.preset} on {args.device}: {args.streams} streams, one {args.long}-token prompt")
    for r in result["interference"]:
        it = r["itl"]
        print(f"  {r['mode']:>20}: ITL p50/p99/max before {_ms(it['before']['p50_ms'])}/"
              f"{_ms(it['before']['p99_ms'])}/{_ms(it['before']['max_ms'])} during {_ms(it['during']['p50_ms'])}/"
              f"{_ms(it['during']['p99_ms'])}/{_ms(it['during']['max_ms'])} after {_ms(it['after']['p50_ms'])}/"
              f"{_ms(it['after']['p99_ms'])} ms | "
              f"long TTFT {r['long_ttft_ms']:.0f} ms ({r['long_x_floor']:.2f}x floor) | shorts' TTFT p50 "
              f"{r['short_ttft_ms']['p50_ms'] or float('nan'):.0f} "
              f"max {r['short_ttft_ms']['max_ms'] or float('nan'):.0f} ms")
    for r in result["agent_turns"]:
        print(f"  agent turn {r['turn']:>2}: {r['new']:>5} new over {r['cached']:>6} cached: "
              f"TTFT {r['ttft_ms']:.1f} ms, "
              f"floor {r['floor_ms']:.1f} ms, {r['x_floor']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
