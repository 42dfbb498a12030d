"""Soak: N concurrent streaming requests through the gateway on CPU engines for a bounded time.

    python -m bench.soak                                   # 200 streams, 10 minutes, disaggregated (P/D over NIXL)
    python -m bench.soak --duration 120 --mode collocated  # a shorter run, one engine
    python -m bench.soak --duration 60 --out soak.json     # figures as JSON too

Everything runs on loopback: a prefill and a decode engine (or one collocated engine) and a gateway with
--gateway-workers processes, all real `token-engine serve` / `render-service serve` processes on the
default bundle (random weights, Qwen3 tokenizer; built locally, no hub). Each of the N client tasks sends
one streaming /v1/completions request after another (a random 8-64 token prompt, a fixed number of
tokens with ignore_eos) until the deadline, then finishes the stream it is in: the loop stops by itself.

Pass criteria (exit status 1 when one fails), printed with the figures:
- 0 errors: every stream returns 200, carries exactly --max-tokens tokens, no error event, ends in [DONE];
- RSS growth <= 5% per server (engines, gateway parent and workers), from the end of the warm-up (a tenth
  of the run, under load) to the end of the run (under the same load), so allocator warm-up is not growth;
- KV blocks back to idle: after the load, every engine's free blocks equal its total and no lease is held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.portable import write_result


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = open(log_dir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def wait_healthy(self, limit_s: float = 300) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name} did not come up in {limit_s:.0f}s")

    def rss_bytes(self) -> int:
        """This server's resident memory: the process and its children (pre-forked workers)."""
        root = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def start_stack(args: argparse.Namespace, model: str, log_dir: Path) -> tuple[list[Proc], Proc]:
    engine_flags = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "16",
                    "--num-gpu-blocks-override", str(args.engine_blocks), "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", "4096", "--log-level", "warning", "--log-format", "json"]

    def engine(name: str, kv: bool) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", "token_engine.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                *engine_flags]
        env = {}
        if kv:
            argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                                         "engine_id": f"soak-{name}"})]
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        return Proc(name, argv, port, log_dir, env)

    engines = [engine("prefill", True), engine("decode", True)] if args.mode == "disaggregated" \
        else [engine("engine", False)]
    for e in engines:
        e.wait_healthy()
    pools = ["--prefill", engines[0].url, "--decode", engines[1].url] if args.mode == "disaggregated" \
        else ["--engine", engines[0].url]
    port = free_port()
    gateway = Proc("gateway", [sys.executable, "-m", "render_service.cli", "serve", model, "--host", "127.0.0.1",
                               "--port", str(port), "--served-model-name", "soak", "--workers",
                               str(args.gateway_workers), "--engine-block-size", "16", "--log-level", "warning",
                               "--log-format", "json", "--disable-uvicorn-access-log", *pools], port, log_dir)
    gateway.wait_healthy()
    return engines, gateway


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.errors: list[str] = []
        self.tokens = 0
        self.ttft: list[float] = []
        self.e2e: list[float] = []


async def one_stream(http: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, tally: Tally) -> None:
    prompt = [rng.randrange(1000, 50000) for _ in range(rng.randint(8, 64))]
    body = {"model": "soak", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    done = False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                tally.errors.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    tally.errors.append(f"error event: {data[:200]}")
                    return
                if event["choices"] and first is None:
                    first = time.perf_counter() - started
                if event.get("usage"):  # the last event before [DONE]: the token count as the server saw it
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        tally.errors.append(f"{type(exc).__name__}: {exc}")
        return
    if not done or tokens != args.max_tokens:
        tally.errors.append(f"stream ended with {tokens} tokens, [DONE]={done}")
        return
    tally.ok += 1
    tally.tokens += tokens
    tally.ttft.append(first or 0.0)
    tally.e2e.append(time.perf_counter() - started)


async def drive(args: argparse.Namespace, gateway: Proc, servers: list[Proc]) -> dict:
    tally = Tally()
    deadline = time.monotonic() + args.duration
    warm_at = time.monotonic() + args.duration * args.warmup_fraction
    rss: dict[str, dict[str, int]] = {}

    async def sample_rss(key: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        rss[key] = {s.name: s.rss_bytes() for s in servers}

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        while time.monotonic() < deadline:
            await one_stream(http, args, rng, tally)

    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=httpx.Timeout(300), limits=limits) as http:
        samplers = [asyncio.ensure_future(sample_rss("warm", warm_at)),
                    asyncio.ensure_future(sample_rss("end", deadline - min(5.0, args.duration * 0.05)))]
        started = time.monotonic()
        await asyncio.gather(*(client(i, http) for i in range(args.concurrency)))
        elapsed = time.monotonic() - started
        await asyncio.gather(*samplers)
    return {"tally": tally, "elapsed_s": elapsed, "rss": rss}


def kv_idle(engine: Proc, attempts: int = 1200) -> dict:
    state = {}
    for _ in range(attempts):  # bounded: 60 s
        state = httpx.get(engine.url + "/debug/kv_cache", timeout=30).json()
        if state["num_running"] == 0 and state["num_waiting"] == 0 and state["num_held_by_connector"] == 0 \
                and state["num_free_blocks"] == state["num_blocks"]:
            break
        time.sleep(0.05)
    return state


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 10 minutes)")
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--mode", choices=["disaggregated", "collocated"], default="disaggregated")
    ap.add_argument("--gateway-workers", type=int, default=2)
    ap.add_argument("--engine-blocks", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--warmup-fraction", type=float, default=0.1)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in default bundle)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    if args.model is None:
        from render_service.bundle.default_bundle import default_bundle_dir
        from token_engine.models.bundle_weights import with_random_weights

        args.model = str(with_random_weights(default_bundle_dir()))
    log_dir = Path(tempfile.mkdtemp(prefix="soak-logs-"))
    servers: list[Proc] = []
    try:
        engines, gateway = start_stack(args, args.model, log_dir)
        servers = [*engines, gateway]
        run = asyncio.run(drive(args, gateway, servers))
        kv = {e.name: kv_idle(e) for e in engines}
    finally:
        for s in reversed(servers):
            s.stop()
    tally: Tally = run["tally"]
    growth = {name: (run["rss"]["end"][name] - warm) / warm for name, warm in run["rss"]["warm"].items()}
    kv_ok = all(s["num_free_blocks"] == s["num_blocks"] and s["num_held_by_connector"] == 0 for s in kv.values())
    figures = {
        "mode": args.mode, "concurrency": args.concurrency, "duration_s": args.duration,
        "elapsed_s": round(run["elapsed_s"], 1), "max_tokens": args.max_tokens,
        "gateway_workers": args.gateway_workers, "requests_ok": tally.ok, "errors": len(tally.errors),
        "error_samples": tally.errors[:5], "tokens_per_s": round(tally.tokens / run["elapsed_s"], 1),
        "requests_per_s": round(tally.ok / run["elapsed_s"], 2),
        "ttft_p50_s": round(pct(tally.ttft, 0.5), 3), "ttft_p99_s": round(pct(tally.ttft, 0.99), 3),
        "e2e_p50_s": round(pct(tally.e2e, 0.5), 3), "e2e_p99_s": round(pct(tally.e2e, 0.99), 3),
        "rss_warm_mib": {k: round(v / 2**20, 1) for k, v in run["rss"]["warm"].items()},
        "rss_end_mib": {k: round(v / 2**20, 1) for k, v in run["rss"]["end"].items()},
        "rss_growth_pct": {k: round(100 * v, 2) for k, v in growth.items()},
        "kv_after": {k: {key: v[key] for key in ("num_blocks", "num_free_blocks", "num_held_by_connector")}
                     for k, v in kv.items()},
        "logs": str(log_dir),
    }
    checks = {"0 errors": not tally.errors and tally.ok > 0,
              f"RSS growth <= {100 * args.max_rss_growth:.0f}%": all(g <= args.max_rss_growth for g in growth.values()),
              "KV blocks back to idle": kv_ok}
    figures["checks"] = checks
    print(json.dumps(figures, indent=2))
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    if args.out:
        write_result(Path(args.out), figures)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
