"""Render benchmark: our render server against vLLM 0.32's, side by side in one run.

Workloads (POST /v1/chat/completions/render, the same body over and over, like vLLM's own bench client):
  tools9k   the ~9.2k-token chat with two tools that the shared bench_vllm_render.py sends
  plain10k  one user message of ~9.8k tokens of non-repetitive text (seeded pseudo-random words,
            numbers, CJK, Hangul, emoji), so no word repeats often enough to flatter a cache

For each round, each server (alternating which goes first) and each workload, C concurrent
keep-alive clients send requests for --duration seconds. Reported per run: requests/s, server CPU
ms per render (utime+stime of the server's process tree from /proc, before/after), p50 latency.
Both servers must return identical token_ids for each body (checked before timing).

Both servers get the qwen3 reasoning parser and the hermes tool parser (vLLM's start.sh "parsers"
mode); ours runs with --workers 2. The client shares the machine's cores with both servers.

usage: python -m bench.render_bench [--duration 10] [--rounds 3] [--concurrency 1,8] [--skip-vllm]
Results: bench/results/render_bench_<UTC time>.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench import peers
from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR

RESULTS = peers.REPO / "bench" / "results"
DEFAULT_MODEL_DIR = QWEN3_DIR
MODEL = "qwen3-0.6b"
RENDER_PATH = "/v1/chat/completions/render"


# ------------------------------------------------------------------------------------------ workloads


def load_peer_bench_module():
    """The shared bench_vllm_render.py, for the exact chat body vLLM's measurements used."""
    path = peers.PEER_RECIPE / "bench_vllm_render.py"
    spec = importlib.util.spec_from_file_location("bench_vllm_render", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tools_chat_body(client: httpx.Client, target_tokens: int) -> tuple[dict, int]:
    peer = load_peer_bench_module()
    return peer.calibrate_render(client, MODEL, target_tokens, True)


def nonrepetitive_text(rng: random.Random, words: int) -> str:
    """Seeded pseudo-random prose: invented words, numbers, CJK, Hangul and emoji; no phrase repeats."""
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w", "z",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "th", "tr", "str", ""]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x"]
    out = []
    for _ in range(words):
        roll = rng.random()
        if roll < 0.80:
            word = "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3)))
            word += rng.choice(codas)
            if rng.random() < 0.1:
                word = word.capitalize()
        elif roll < 0.88:
            word = str(rng.randint(0, 10 ** rng.randint(1, 7)))
        elif roll < 0.93:
            word = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(1, 4)))
        elif roll < 0.98:
            word = "".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(rng.randint(1, 3)))
        else:
            word = chr(rng.randint(0x1F300, 0x1F64F))
        out.append(word)
        if rng.random() < 0.08:
            out.append(rng.choice([".", ",", ";", ":", "!", "?", "\n"]))
    return " ".join(out)


def plain_chat_body(client: httpx.Client, target_tokens: int) -> tuple[dict, int]:
    words = target_tokens // 3
    for _ in range(8):
        text = nonrepetitive_text(random.Random(20261129), words)
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        r = client.post(RENDER_PATH, json=body)
        r.raise_for_status()
        count = len(r.json()["token_ids"])
        if abs(count - target_tokens) <= target_tokens * 0.01:
            break
        words = max(1, round(words * target_tokens / count))
    return body, count


# ------------------------------------------------------------------------------------------- client


async def _post(reader, writer, head: bytes, payload: bytes) -> int:
    """One request on a keep-alive connection; returns the HTTP status."""
    writer.write(head + payload)
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    length = None
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length is None:
        raise RuntimeError("response without content-length")
    await reader.readexactly(length)
    return status


async def load_run(port: int, payload: bytes, concurrency: int, duration: float, pid: int) -> dict:
    head = (f"POST {RENDER_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    done = errors = 0
    latencies: list[float] = []
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(concurrency)]
    # Warm each connection (and whichever worker took it).
    for reader, writer in connections:
        await _post(reader, writer, head, payload)

    stop_at = 0.0

    async def worker(reader, writer):
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            status = await _post(reader, writer, head, payload)
            latencies.append(time.perf_counter() - t)
            if status == 200:
                done += 1
            else:
                errors += 1

    cpu0, wall0, own0 = peers.tree_cpu_seconds(pid), time.perf_counter(), os.times()
    stop_at = wall0 + duration
    await asyncio.gather(*(worker(r, w) for r, w in connections))
    cpu1, wall1, own1 = peers.tree_cpu_seconds(pid), time.perf_counter(), os.times()
    for _, writer in connections:
        writer.close()
    wall = wall1 - wall0
    return {
        "requests": done, "errors": errors, "wall_s": round(wall, 3), "rps": round(done / wall, 2),
        "server_cpu_s": round(cpu1 - cpu0, 3),
        "server_cpu_ms_per_render": round(1e3 * (cpu1 - cpu0) / max(done, 1), 3),
        "server_cores_used": round((cpu1 - cpu0) / wall, 3),
        "client_cpu_s": round((own1.user + own1.system) - (own0.user + own0.system), 3),
        "lat_p50_ms": round(1e3 * statistics.median(latencies), 3) if latencies else None,
    }


# --------------------------------------------------------------------------------------------- main


def machine_load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per timed run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8", help="comma list of concurrent clients")
    ap.add_argument("--workers", type=int, default=2, help="our server's worker processes")
    ap.add_argument("--tools-tokens", type=int, default=9200)
    ap.add_argument("--plain-tokens", type=int, default=9800)
    ap.add_argument("--skip-vllm", action="store_true", help="only our server (no ratios)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    servers: dict[str, dict] = {}
    if not args.skip_vllm:
        peers.install_vllm()
    ours_port = peers.free_port()
    started = time.monotonic()
    ours = peers.start_ours(args.model_dir, ours_port, workers=args.workers)
    servers["ours"] = {"port": ours_port, "pid": ours.pid, "started": started}
    if not args.skip_vllm:
        vllm_port = peers.free_port()
        started = time.monotonic()
        servers["vllm"] = {"port": vllm_port, "pid": peers.start_vllm(args.model_dir, vllm_port), "started": started}
    try:
        for name, info in servers.items():
            peers.wait_healthy(f"http://127.0.0.1:{info['port']}", info["pid"])
            # From process start to the first 200 on /health (the servers start concurrently).
            info["startup_s"] = round(time.monotonic() - info.pop("started"), 2)
            print(f"# {name}: pid {info['pid']} port {info['port']} healthy after {info['startup_s']} s", flush=True)

        with httpx.Client(base_url=f"http://127.0.0.1:{ours_port}", timeout=120) as client:
            tools_body, tools_tokens = tools_chat_body(client, args.tools_tokens)
            plain_body, plain_tokens = plain_chat_body(client, args.plain_tokens)
        workloads = {
            "tools9k": {"body": tools_body, "prompt_tokens": tools_tokens},
            "plain10k": {"body": plain_body, "prompt_tokens": plain_tokens},
        }
        for name, w in workloads.items():
            w["payload"] = json.dumps(w["body"]).encode()
            ids = {}
            for server, info in servers.items():
                r = httpx.post(f"http://127.0.0.1:{info['port']}{RENDER_PATH}", content=w["payload"],
                               headers={"content-type": "application/json"}, timeout=120)
                r.raise_for_status()
                ids[server] = r.json()["token_ids"]
            w["token_ids_equal"] = len({json.dumps(v) for v in ids.values()}) == 1
            print(f"# workload {name}: {w['prompt_tokens']} prompt tokens, {len(w['payload'])} bytes, "
                  f"token_ids equal across servers: {w['token_ids_equal']}", flush=True)

        runs = []
        order = list(servers)
        for round_no in range(args.rounds):
            for server in (order if round_no % 2 == 0 else order[::-1]):
                info = servers[server]
                for wname, w in workloads.items():
                    for c in levels:
                        result = asyncio.run(load_run(info["port"], w["payload"], c, args.duration, info["pid"]))
                        row = {"round": round_no, "server": server, "workload": wname, "concurrency": c,
                               "loadavg": machine_load(), **result}
                        runs.append(row)
                        print(json.dumps(row), flush=True)

        summary = summarize(runs, servers, workloads, levels)
        report = {
            "command": " ".join([sys.executable, "-m", "bench.render_bench", *(argv or sys.argv[1:])]),
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(), "ours_workers": args.workers, "duration_s": args.duration,
            "rounds": args.rounds,
            "servers": {k: {kk: vv for kk, vv in v.items()} for k, v in servers.items()},
            "workloads": {k: {"prompt_tokens": v["prompt_tokens"], "body_bytes": len(v["payload"]),
                              "token_ids_equal": v["token_ids_equal"]} for k, v in workloads.items()},
            "summary": summary, "runs": runs,
        }
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
        out = Path(args.out) if args.out else RESULTS / f"render_bench_{stamp}.json"
        write_result(out, report)
        print("SUMMARY " + json.dumps(summary), flush=True)
        print(f"# wrote {out}", flush=True)
    finally:
        peers.stop_tree(ours.pid)
        ours.wait(timeout=30)
        if "vllm" in servers:
            peers.stop_tree(servers["vllm"]["pid"])
    return 0


def summarize(runs: list[dict], servers: dict, workloads: dict, levels: list[int]) -> dict:
    """Medians per (server, workload, concurrency), and ours/vLLM ratios where both ran."""
    out: dict = {}
    for wname in workloads:
        for c in levels:
            key = f"{wname}@c{c}"
            cell: dict = {}
            for server in servers:
                rows = [r for r in runs if r["server"] == server and r["workload"] == wname and r["concurrency"] == c]
                if rows:
                    cell[server] = {
                        "rps": statistics.median(r["rps"] for r in rows),
                        "server_cpu_ms_per_render": statistics.median(r["server_cpu_ms_per_render"] for r in rows),
                        "server_cores_used": statistics.median(r["server_cores_used"] for r in rows),
                        "lat_p50_ms": statistics.median(r["lat_p50_ms"] for r in rows if r["lat_p50_ms"] is not None),
                    }
            if "ours" in cell and "vllm" in cell:
                cell["rps_ratio_ours_over_vllm"] = round(cell["ours"]["rps"] / cell["vllm"]["rps"], 2)
                cell["cpu_ratio_ours_over_vllm"] = round(
                    cell["ours"]["server_cpu_ms_per_render"] / cell["vllm"]["server_cpu_ms_per_render"], 3)
            out[key] = cell
    return out


if __name__ == "__main__":
    sys.exit(main())
