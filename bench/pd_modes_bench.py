"""TTFT and KV handoff time of P/D pull vs push vs collocated, same run, same prompts, real engines.

Two `token-engine serve` processes (prefill and decode, both NixlPushConnector, which serves pull params too;
prefix caching off so every mode computes every prompt) and the gateway's own dispatch in this process
(render_service.gateway.flow.Gateway): collocated = the decode engine alone; pull = prefill, then decode READs;
push = both legs at once, prefill WRITEs into the blocks decode reserved. TTFT is gateway-side, from the call
to the first token event; "handoff" is the engines' own figure (splitserve:kv_handoff_seconds: pull = decode's
READ through lease confirmation, push = prefill's last WRITE posted to DONE, the part after compute).

    python -m bench.pd_modes_bench --tokens 1024,8192,32768 --requests 2          # CPU, tiny model, ~1-2 min
    python -m bench.pd_modes_bench --device cuda --preset qwen2.5-7b --tokens 1024,8192,32768 --requests 5 \
        --out bench/results/pd_modes_nvidia-h200.json                                      # one GPU, two engines on it

On CUDA both engines share the one GPU (each gets --kv-blocks blocks and its own copy of the weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODES = ("collocated", "pull", "push")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, model: Path, engine_id: str, args, log_dir: Path):
        self.port, self.side_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kv = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "engine_id": engine_id,
              "kv_buffer_device": "cuda" if args.device == "cuda" else "cpu",
              "kv_connector_extra_config": {"kv_load_timeout": 300, "kv_lease_duration": 300}}
        argv = [sys.executable, "-m", "token_engine.cli", "serve", str(model), "--device", args.device,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype,
                "--max-model-len", str(max(args.tokens) + 64), "--block-size", str(args.block_size),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "4",
                "--num-gpu-blocks-override", str(args.kv_blocks), "--no-enable-prefix-caching",
                "--log-level", "warning", "--kv-transfer-config", json.dumps(kv)]
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port)}
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(args.threads))
        self.log = open(log_dir / f"{engine_id}.log", "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def wait(self, limit_s: float = 900) -> None:
        deadline = time.monotonic() + limit_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not come up")
            time.sleep(0.5)

    def handoff(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(mode, side) -> (handoffs, seconds) from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict = {}
        for name, i in (("splitserve:kv_handoffs_total", 0), ("splitserve:kv_handoff_seconds_total", 1)):
            for m in re.finditer(re.escape(name) + r'\{mode="(\w+)",side="(\w+)"\} ([0-9.e+-]+)', text):
                pair = list(out.get((m[1], m[2]), (0.0, 0.0)))
                pair[i] = float(m[3])
                out[(m[1], m[2])] = tuple(pair)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


async def ttft(gw, token_ids: list[int], rid: str) -> float:
    from render_service.gateway.flow import EngineCall
    from render_service.wire.protocol import GenerateRequest, SamplingParams

    gen = GenerateRequest(request_id=rid, token_ids=token_ids,
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.perf_counter()
    live = await gw.open(gen, EngineCall())
    elapsed = time.perf_counter() - t0
    live.close()  # the first token is what is measured; the engine aborts the rest
    return elapsed


def _mean_ms(values: list[float]) -> float:
    return statistics.fmean(values) * 1e3 if values else float("nan")


async def run(args, prefill: Engine, decode: Engine) -> dict:
    from render_service.gateway.flow import Gateway, GatewaySettings

    settings = dict(block_size=args.block_size, retries=0)
    gws = {"collocated": Gateway(engines=[decode.url], settings=GatewaySettings(**settings)),
           "pull": Gateway(prefill=[prefill.url], decode=[decode.url],
                           settings=GatewaySettings(**settings, pd_transfer_mode="pull")),
           "push": Gateway(prefill=[prefill.url], decode=[decode.url],
                           settings=GatewaySettings(**settings, pd_transfer_mode="push"))}
    rng = random.Random(0)
    # warm-up: wire-up of NIXL in both directions, the push gateway learns prefill's side channel, kernels
    warm = [rng.randrange(1000, 30000) for _ in range(min(args.tokens))]
    for mode in MODES:
        for i in range(2):
            await ttft(gws[mode], warm, f"warm-{mode}-{i}")
    results: dict = {}
    for n in args.tokens:
        prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for _ in range(args.requests)]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        before = {"pull": decode.handoff(), "push": prefill.handoff()}
        for i, prompt in enumerate(prompts):
            for mode in MODES:  # interleaved: drift on a shared box hits every mode alike
                times[mode].append(await ttft(gws[mode], prompt, f"{mode}-{n}-{i}"))
                await asyncio.sleep(0.05)
        after = {"pull": decode.handoff(), "push": prefill.handoff()}
        row = {m: {"ttft_ms_mean": _mean_ms(times[m]), "ttft_ms_min": min(times[m]) * 1e3,
                   "ttft_ms_all": [t * 1e3 for t in times[m]]} for m in MODES}
        for mode, side in (("pull", "decode"), ("push", "prefill")):
            c0, s0 = before[mode].get((mode, side), (0.0, 0.0))
            c1, s1 = after[mode].get((mode, side), (0.0, 0.0))
            row[mode]["handoff_ms_mean"] = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
            row[mode]["handoffs"] = c1 - c0
        base = row["collocated"]["ttft_ms_mean"]
        for m in ("pull", "push"):
            row[m]["ttft_ratio_vs_collocated"] = row[m]["ttft_ms_mean"] / base
        results[str(n)] = row
        print(f"{n:>6} tokens: " + "  ".join(
            f"{m} {row[m]['ttft_ms_mean']:.1f} ms" + (f" (x{row[m]['ttft_ratio_vs_collocated']:.3f}, handoff "
                                                      f"{row[m]['handoff_ms_mean'] or float('nan'):.2f} ms)"
                                                      if m != "collocated" else "") for m in MODES),
              file=sys.stderr, flush=True)
    for gw in gws.values():
        await gw.client.aclose()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--preset", default="tiny", help="random-weight model shape (token_engine.models.random_model)")
    ap.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths, comma-separated")
    ap.add_argument("--requests", type=int, default=2, help="prompts per length (each served in every mode)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill chunk (engine flag)")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per engine (default: 2 prompts' worth)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads per engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.kv_blocks = args.kv_blocks or 2 * (-(-(max(args.tokens) + 64) // args.block_size)) + 16

    from token_engine.models.random_model import write_random_model

    with tempfile.TemporaryDirectory(prefix="pd-modes-") as tmp:
        tmp = Path(tmp)
        model = write_random_model(tmp / "model", preset=args.preset, dtype=args.dtype,
                                   overrides={"max_position_embeddings": max(args.tokens) + 1024})
        prefill, decode = Engine(model, "bench-prefill", args, tmp), Engine(model, "bench-decode", args, tmp)
        try:
            prefill.wait()
            decode.wait()
            results = asyncio.run(run(args, prefill, decode))
        finally:
            prefill.stop()
            decode.stop()
    record = {"bench": "pd_modes", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m bench.pd_modes_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "host": platform.node(), "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
              "device": args.device, "preset": args.preset, "block_size": args.block_size,
              "max_num_batched_tokens": args.max_num_batched_tokens, "results": results}
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
