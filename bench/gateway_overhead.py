"""Gateway CPU overhead: the same streamed chat requests sent to the engine directly and through the gateway.

One tiny random-weight Qwen3 engine process (real Qwen3 tokenizer, so the text is real byte-level
detokenization) and one gateway process (`render-service serve --engine URL`, qwen3 reasoning parser
and hermes tool parser on, as deployed). Each phase sends the same N chat requests at concurrency C:

* direct: the rendered token IDs (from the gateway's own /render) to /inference/v1/generate, streamed;
* gateway: the chat request to /v1/chat/completions, streamed, with usage.

Gateway CPU is utime+stime of the gateway process from /proc (other load on the machine does not count),
taken around each phase. Two output lengths (max_tokens 1 and T, ignore_eos) separate the per-request
cost (render, routing, the engine call, the first and last chunks) from the per-token cost (engine SSE
in, derender pipeline, OpenAI SSE out):

    per_request = gateway CPU(short) / N
    per_token   = (gateway CPU(long) - gateway CPU(short)) / (N * (T - 1))

each less the gateway's idle CPU rate (measured during the direct phases) times the phase's wall time.

The bench also times the gateway's own work in-process (render per request; derender pipeline, chunk
building and JSON encoding per token): the rest of the per-request and per-token CPU is HTTP and asyncio
plumbing (uvicorn, Starlette, the engine connection).

Wall time of each phase is reported next to the direct run's wall time of the same phase (the ratio is
the end-to-end cost of the extra hop on this machine, where client, gateway and engine share the cores).

    .venv/bin/python -m bench.gateway_overhead --requests 200 --tokens 128 --concurrency 8

Results: bench/results/gateway_overhead.json (targets: <= 1 ms per request, <= 50 us per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SHARED = Path("/work/shared") if Path("/work/shared/fixtures").exists() else Path(__file__).resolve().parents[2] / "shared"
ROOT = Path(__file__).resolve().parent.parent
QWEN = SHARED / "fixtures/qwen3-0.6b"
TICKS = os.sysconf("SC_CLK_TCK")

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that answers briefly."},
    {"role": "user", "content": "Tell me about the weather in Paris and what to wear today."},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def start(argv: list[str], port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(log_path, "wb")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(log_path.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"server on port {port} did not come up")
        time.sleep(0.2)


async def stream_direct(client: httpx.AsyncClient, url: str, token_ids: list[int], max_tokens: int) -> int:
    body = {"token_ids": token_ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}
    events = 0
    async with client.stream("POST", url + "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
    return events


async def stream_gateway(client: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    body = {"model": "bench", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if '"error"' in line[:20]:
                    raise RuntimeError(line)
    return events


async def run_phase(kind: str, n: int, concurrency: int, max_tokens: int, engine_url: str, gateway_url: str,
                    token_ids: list[int]) -> float:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                queue.pop()
                if kind == "direct":
                    await stream_direct(client, engine_url, token_ids, max_tokens)
                else:
                    await stream_gateway(client, gateway_url, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def measure(kind: str, args, max_tokens: int, procs: dict, urls: dict, token_ids: list[int]) -> dict:
    before = {name: cpu_seconds(p.pid) for name, p in procs.items()}
    wall = asyncio.run(run_phase(kind, args.requests, args.concurrency, max_tokens, urls["engine"], urls["gateway"],
                                 token_ids))
    after = {name: cpu_seconds(p.pid) for name, p in procs.items()}
    return {"kind": kind, "max_tokens": max_tokens, "requests": args.requests, "wall_s": round(wall, 3),
            "cpu_s": {name: round(after[name] - before[name], 3) for name in procs}}


def in_process_costs(model_dir: Path, samples: int = 300, tokens: int = 2000) -> dict:
    """The gateway's own work without any HTTP: render per request, derender + chunk encoding per token
    (the same objects the routes use), CPU time of this process."""
    import random

    import msgspec

    from render_service.gateway.responses import ChatResponder
    from render_service.protocol import ChatCompletionRequest, GenerateStreamResponse
    from render_service.render import load_render_config, render_chat

    config = load_render_config(str(model_dir), served_model_names=["bench"], reasoning_parser="qwen3",
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    req = ChatCompletionRequest(messages=MESSAGES, stream=True, max_tokens=tokens, ignore_eos=True)
    started = time.process_time()
    for _ in range(samples):
        gen = render_chat(req, config)
    render_us = (time.process_time() - started) / samples * 1e6
    rnd = random.Random(0)
    events = [msgspec.json.encode({"request_id": "x", "choices": [{"index": 0, "token_ids": [rnd.randrange(150000)],
                                                                     "finish_reason": None}]}) for _ in range(tokens)]
    decode = msgspec.json.Decoder(GenerateStreamResponse).decode
    responder = ChatResponder(gen, req, config)
    started = time.process_time()
    for raw in events:
        for choice in decode(raw).choices:
            responder.stream_events(0, choice)
    token_us = (time.process_time() - started) / tokens * 1e6
    return {"render_chat_us_per_request": round(render_us, 1), "derender_and_encode_us_per_token": round(token_us, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of the long phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gateway_overhead.json"))
    ap.add_argument("--logs", default=tempfile.gettempdir(), help="where engine.log and gateway.log go")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from token_engine.random_model import write_random_model

    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        model = write_random_model(Path(tmp) / "tiny", arch="qwen3", preset="tiny",
                                   overrides={"tie_word_embeddings": False}, tokenizer_dir=QWEN, dtype="float32")
        engine_port, gateway_port = free_port(), free_port()
        max_len = 64 + args.tokens + 256
        engine = start([sys.executable, "-m", "token_engine.cli", "serve", str(model), "--host", "127.0.0.1",
                        "--port", str(engine_port), "--dtype", "float32", "--max-model-len", str(max_len),
                        "--max-num-seqs", str(max(args.concurrency, 8)), "--log-level", "warning"], engine_port,
                       Path(args.logs) / "engine.log")
        gateway = None
        try:
            gateway = start([sys.executable, "-m", "render_service.cli", "serve", str(model), "--host", "127.0.0.1",
                             "--port", str(gateway_port), "--served-model-name", "bench", "--reasoning-parser",
                             "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                             "--log-level", "warning", "--engine", f"http://127.0.0.1:{engine_port}"], gateway_port,
                            Path(args.logs) / "gateway.log")
            urls = {"engine": f"http://127.0.0.1:{engine_port}", "gateway": f"http://127.0.0.1:{gateway_port}"}
            rendered = httpx.post(urls["gateway"] + "/v1/chat/completions/render",
                                  json={"model": "bench", "messages": MESSAGES}, timeout=60).json()
            token_ids = rendered["token_ids"]
            procs = {"gateway": gateway, "engine": engine}
            # warm both paths (imports, pipelines, connection pools)
            warm = argparse.Namespace(**{**vars(args), "requests": 2 * args.concurrency})
            for kind in ("direct", "gateway"):
                measure(kind, warm, 8, procs, urls, token_ids)
            in_process = in_process_costs(model)
            phases = []
            for max_tokens in (1, args.tokens):
                for kind in ("direct", "gateway"):
                    phases.append(measure(kind, args, max_tokens, procs, urls, token_ids))
                    print(json.dumps(phases[-1]), flush=True)
        finally:
            for p in (gateway, engine):
                if p is not None and p.poll() is None:
                    p.terminate()
                    p.wait(30)

    by = {(p["kind"], p["max_tokens"]): p for p in phases}
    n, t = args.requests, args.tokens
    # The gateway's CPU while it serves nothing (the direct phases): its idle rate is taken off its
    # busy phases, which last about as long.
    idle_cpu = sum(by[("direct", mt)]["cpu_s"]["gateway"] for mt in (1, t))
    idle_rate = idle_cpu / sum(by[("direct", mt)]["wall_s"] for mt in (1, t))
    short_cpu = by[("gateway", 1)]["cpu_s"]["gateway"] - idle_rate * by[("gateway", 1)]["wall_s"]
    long_cpu = by[("gateway", t)]["cpu_s"]["gateway"] - idle_rate * by[("gateway", t)]["wall_s"]
    per_request_us = short_cpu / n * 1e6
    per_token_us = (long_cpu - short_cpu) / (n * (t - 1)) * 1e6
    result = {
        "bench": "gateway_overhead",
        "command": " ".join([".venv/bin/python -m bench.gateway_overhead", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "setup": {"requests": n, "tokens": t, "concurrency": args.concurrency, "prompt_tokens": len(token_ids),
                  "model": "tiny random Qwen3 (Qwen3 tokenizer), CPU engine", "parsers": "qwen3 + hermes"},
        "phases": phases,
        "in_process": in_process,
        "gateway_idle_cpu_per_s": round(idle_rate, 5),
        "gateway_cpu_per_request_us": round(per_request_us, 1),
        "gateway_cpu_per_token_us": round(per_token_us, 1),
        "targets": {"per_request_us": 1000, "per_token_us": 50},
        "meets_targets": per_request_us <= 1000 and per_token_us <= 50,
        "wall_ratio_gateway_over_direct": {
            str(mt): round(by[("gateway", mt)]["wall_s"] / by[("direct", mt)]["wall_s"], 3) for mt in (1, t)},
        "engine_cpu_ratio_gateway_over_direct": {
            str(mt): round(by[("gateway", mt)]["cpu_s"]["engine"] / max(by[("direct", mt)]["cpu_s"]["engine"], 1e-9), 3)
            for mt in (1, t)},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("gateway_cpu_per_request_us", "gateway_cpu_per_token_us",
                                             "meets_targets", "wall_ratio_gateway_over_direct")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
