"""``splitserve-bench sizing``: how many render workers and replicas a target load needs, from measurements.

Against each render server (ours, vLLM's ``vllm launch render`` or vLLM 0.34's Rust ``vllm-rs render``; same
render endpoints; vllm-rs has no derender, so its derender rows are left out):
  render      closed-loop POST /v1/chat/completions/render of one chat at each prompt length (default 1k, 4k,
              9k, 32k tokens), without and with tools: req/s, server CPU ms per render, latency p50/p99.
  derender    one stream of N tokens fed to POST /v1/chat/completions/derender (stream=true, echoing
              stream_state) per request-side parser configuration (plain content; reasoning; reasoning and a
              tool call with tools in the request) and chunk size: server CPU per token and per chunk, request
              and response bytes per chunk.
  concurrency render at one length with C concurrent clients: scaling of req/s and CPU per render.

Server CPU is utime+stime from /proc of --server-pid's process tree or, for a local server without one,
of every process listening on the port (/proc/net/tcp, tcp6), so other load on the machine does not count.
The recommendation: cores = target_render_rps * cpu_per_render + streams * tokens/s * cpu_per_token, divided
by (1 - headroom); one worker process is one core (Python, one event loop); replicas hold --workers-per-replica.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from bench import peers
from bench.portable import write_result
from bench.render_bench import _post, nonrepetitive_text
from bench.shared_fixtures import QWEN3_DIR

RENDER_PATH = "/v1/chat/completions/render"
DERENDER_PATH = "/v1/chat/completions/derender"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"}
PARSER_CONFIGS = ("plain", "reasoning", "tools")

SIZING_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Search flights between two airports on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "passengers": {"type": "integer", "minimum": 1}}, "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {
        "name": "run_sql", "description": "Run a read-only SQL query against the analytics warehouse.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "default": 100}}, "required": ["query"]}}},
]
REASONING_TEXT = ("The user wants the weather in Seoul; get_weather is the right tool, with the city and the "
                  "unit, and then I will summarise humidity, wind and the chance of rain in plain words. ")
CONTENT_TEXT = ("Seoul is clear in the morning with clouds after noon, 21°C at the warmest and a light "
                "north-west breeze; rain is unlikely before Friday. ")


# ------------------------------------------------------------------------------------------- server CPU


def listening_pids(port: int) -> list[int]:
    """Every process holding a listening socket on ``port`` (uvicorn workers share the parent's socket)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            if parts[1].rsplit(":", 1)[1] == f"{port:04X}" and parts[3] == "0A":
                inodes.add(f"socket:[{parts[9]}]")
    pids = []
    if not inodes:
        return pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(pids)


class ServerCPU:
    """utime+stime of a set of process trees, each process counted once."""

    def __init__(self, roots: list[int]):
        self.roots = roots

    def seconds(self) -> float:
        seen: set[int] = set()
        for root in self.roots:
            seen.update(peers.tree_pids(root))
        total = 0
        for pid in seen:
            try:
                raw = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
        return total / peers.CLOCK_TICKS


class Target:
    """One server under test."""

    def __init__(self, label: str, base_url: str, pid: int | None = None):
        self.label = label
        self.base_url = base_url.rstrip("/")
        url = urlparse(self.base_url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        roots = [pid] if pid else (listening_pids(self.port) if self.host in LOCAL_HOSTS else [])
        self.cpu = ServerCPU(roots) if roots else None
        self.pids = roots

    def cpu_seconds(self) -> float | None:
        return self.cpu.seconds() if self.cpu else None


# ------------------------------------------------------------------------------------------- workloads


def chat_with_tokens(client: httpx.Client, model: str, target_tokens: int, tools: bool,
                     seed: int = 7) -> tuple[dict, int]:
    """A one-message chat whose rendered prompt is within 1% of ``target_tokens``, tools and template included
    (a target below the template-and-tools floor gets the floor)."""

    def render(words: int) -> tuple[dict, int]:
        text = nonrepetitive_text(random.Random(seed), words)
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        if tools:
            body["tools"] = SIZING_TOOLS
        response = client.post(RENDER_PATH, json=body)
        response.raise_for_status()
        return body, len(response.json()["token_ids"])

    body, floor = render(1)
    if target_tokens <= floor:
        return body, floor
    words = max((target_tokens - floor) // 3, 1)
    for _ in range(8):
        body, count = render(words)
        if abs(count - target_tokens) <= target_tokens * 0.01:
            break
        per_word = max((count - floor) / words, 1e-3)  # the fixed part does not scale with the text
        words = max(1, round((target_tokens - floor) / per_word))
    return body, count


async def closed_loop(target: Target, path: str, payload: bytes, concurrency: int, duration_s: float) -> dict:
    """C keep-alive connections each sending the same body back to back for ``duration_s``."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    connections = [await asyncio.open_connection(target.host, target.port) for _ in range(concurrency)]
    for reader, writer in connections:  # warm each connection and whichever worker took it
        await _post(reader, writer, head, payload)
    done = errors = 0
    latencies: list[float] = []
    stop_at = 0.0

    async def client(reader, writer) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            status = await _post(reader, writer, head, payload)
            latencies.append(time.perf_counter() - t)
            done, errors = (done + 1, errors) if status == 200 else (done, errors + 1)

    cpu0, wall0 = target.cpu_seconds(), time.perf_counter()
    stop_at = wall0 + duration_s
    await asyncio.gather(*(client(r, w) for r, w in connections))
    cpu1, wall = target.cpu_seconds(), time.perf_counter() - wall0
    for _, writer in connections:
        writer.close()
    cpu = (cpu1 - cpu0) if cpu0 is not None else None
    latencies.sort()
    return {
        "concurrency": concurrency, "requests": done, "errors": errors, "wall_s": round(wall, 3),
        "rps": round(done / wall, 2),
        "server_cpu_ms_per_render": round(1e3 * cpu / done, 3) if cpu is not None and done else None,
        "server_cores_used": round(cpu / wall, 3) if cpu is not None else None,
        "lat_p50_ms": round(1e3 * latencies[len(latencies) // 2], 2) if latencies else None,
        "lat_p99_ms": (round(1e3 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2)
                       if latencies else None),
    }


def stream_output(tokenizer, n: int, config: str) -> list[int]:
    """N output token ids for a parser configuration, ending with <|im_end|>."""
    end = tokenizer.token_to_id("<|im_end|>")
    body_budget = n - 1
    if config == "plain":
        ids = tokenizer.encode(CONTENT_TEXT * (n // 10 + 2), add_special_tokens=False).ids[:body_budget]
        return ids + [end]
    head = tokenizer.encode("<think>\n", add_special_tokens=False).ids
    mid = tokenizer.encode("\n</think>\n\n", add_special_tokens=False).ids
    tail = []
    if config == "tools":
        call = {"name": "get_weather", "arguments": {"city": "Seoul", "unit": "celsius"}}
        tail = tokenizer.encode("\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>", add_special_tokens=False).ids
    budget = body_budget - len(head) - len(mid) - len(tail)
    if budget < 2:
        raise ValueError(f"--derender-tokens {n} is too short for the {config} stream")
    reasoning = tokenizer.encode(REASONING_TEXT * (n // 10 + 2), add_special_tokens=False).ids[: budget // 2]
    content = tokenizer.encode(CONTENT_TEXT * (n // 10 + 2), add_special_tokens=False).ids[: budget - len(reasoning)]
    return head + reasoning + mid + content + tail + [end]


def derender_stream(client: httpx.Client, target: Target, model: str, chat: dict, prompt_ids: list[int],
                    output: list[int], chunk_tokens: int, request_id: str) -> dict:
    """Feeds ``output`` in chunks, echoing stream_state as a client does; CPU and bytes per chunk."""
    state = None
    sent = received = chunks = 0
    finish = None
    cpu0, wall0 = target.cpu_seconds(), time.perf_counter()
    for start in range(0, len(output), chunk_tokens):
        piece = output[start:start + chunk_tokens]
        last = start + chunk_tokens >= len(output)
        body = {"stream": True, "model": model, "stream_state": state, "prompt_tokens": len(prompt_ids),
                "prompt_token_ids": prompt_ids, "chat_request": chat,
                "generate_chunk": {"request_id": request_id, "choices": [
                    {"index": 0, "token_ids": piece, "finish_reason": "stop" if last else None}]}}
        payload = json.dumps(body).encode()
        response = client.post(DERENDER_PATH, content=payload, headers={"content-type": "application/json"})
        if response.status_code != 200:
            raise RuntimeError(f"{target.label} derender HTTP {response.status_code}: {response.text[:300]}")
        sent += len(payload)
        received += len(response.content)
        chunks += 1
        answer = response.json()
        state = answer.get("stream_state")
        for choice in (answer.get("chunk") or {}).get("choices") or []:
            finish = choice.get("finish_reason") or finish
    wall = time.perf_counter() - wall0
    cpu1 = target.cpu_seconds()
    cpu = (cpu1 - cpu0) if cpu0 is not None else None
    return {
        "tokens": len(output), "chunk_tokens": chunk_tokens, "chunks": chunks, "wall_s": round(wall, 3),
        "server_cpu_ms_per_token": round(1e3 * cpu / len(output), 4) if cpu is not None else None,
        "server_cpu_ms_per_chunk": round(1e3 * cpu / chunks, 4) if cpu is not None else None,
        "wall_ms_per_chunk": round(1e3 * wall / chunks, 3),
        "request_bytes_per_chunk": round(sent / chunks, 1), "response_bytes_per_chunk": round(received / chunks, 1),
        "last_state_bytes": len(json.dumps(state)), "finish_reason": finish,
    }


def repeated_streams(client: httpx.Client, target: Target, model: str, chat: dict, prompt_ids: list[int],
                     output: list[int], chunk_tokens: int, request_id: str, min_wall_s: float) -> dict:
    """The same stream again until ``min_wall_s`` has passed: /proc counts CPU in 10 ms ticks, so one short
    stream's CPU would be mostly rounding."""
    rows = []
    started = time.perf_counter()
    while not rows or time.perf_counter() - started < min_wall_s:
        rows.append(derender_stream(client, target, model, chat, prompt_ids, output, chunk_tokens,
                                    f"{request_id}-{len(rows)}"))
    row = dict(rows[-1])
    row["streams"] = len(rows)
    row["wall_ms_per_chunk"] = round(statistics.fmean(r["wall_ms_per_chunk"] for r in rows), 3)
    if row["server_cpu_ms_per_token"] is not None:
        for key in ("server_cpu_ms_per_token", "server_cpu_ms_per_chunk"):
            row[key] = round(statistics.fmean(r[key] for r in rows), 4)
    return row


# ------------------------------------------------------------------------------------------- recommendation


def interpolate(points: dict[int, float], x: int) -> float:
    """Linear in prompt length between the nearest measured lengths (CPU per render is about linear)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]] * x / xs[0]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[xs[-1]] * x / xs[-1]


def recommend(render_ms: float, token_ms: float, target_rps: float, streams: int, tokens_per_s: float,
              headroom: float, workers_per_replica: int, image_ms: float = 0.0, images_per_render: int = 0) -> dict:
    """``image_ms``: server CPU per image (its request's share of text included: a little conservative);
    ``images_per_render``: images in each of the ``target_rps`` renders. Image work runs in the pool's worker
    processes, which need cores of their own besides the server processes."""
    if not 0 <= headroom < 1:
        raise ValueError("--headroom must be in [0, 1)")
    render_cores = target_rps * render_ms / 1e3
    stream_cores = streams * tokens_per_s * token_ms / 1e3
    image_cores = target_rps * images_per_render * image_ms / 1e3
    needed = (render_cores + stream_cores + image_cores) / (1 - headroom)
    workers = max(1, math.ceil(needed))
    return {
        "cpu_ms_per_render": round(render_ms, 3), "cpu_ms_per_streamed_token": round(token_ms, 4),
        "render_cores": round(render_cores, 3), "stream_cores": round(stream_cores, 3),
        "cpu_ms_per_image": round(image_ms, 3), "images_per_render": images_per_render,
        "image_cores": round(image_cores, 3),
        "cores_with_headroom": round(needed, 3), "worker_processes": workers,
        "replicas": math.ceil(workers / workers_per_replica), "workers_per_replica": workers_per_replica,
        "render_rps_per_worker": round(1e3 / render_ms * (1 - headroom), 1) if render_ms else None,
        "streams_per_worker": round(1e3 / (tokens_per_s * token_ms) * (1 - headroom), 1) if token_ms else None,
    }


# ------------------------------------------------------------------------------------------- the run


def measure(target: Target, model: str, tokenizer, args, log) -> dict:
    section: dict = {"label": target.label, "base_url": target.base_url, "pids": target.pids,
                     "cpu_source": "/proc" if target.cpu else "none (remote server: wall-clock only)"}
    render_rows, bodies = [], {}
    with httpx.Client(base_url=target.base_url, timeout=600) as client:
        for tools in (False, True):
            for length in args.prompt_lens:
                body, count = chat_with_tokens(client, model, length, tools)
                payload = json.dumps(body).encode()
                bodies[(length, tools)] = payload
                row = asyncio.run(closed_loop(target, RENDER_PATH, payload, args.render_concurrency, args.duration))
                row = {"prompt_tokens_target": length, "prompt_tokens": count, "tools": tools,
                       "body_bytes": len(payload), **row}
                cpu_ms = row.get("server_cpu_ms_per_render")
                row["rps_per_core"] = round(1e3 / cpu_ms, 1) if cpu_ms else None  # one core busy rendering
                render_rows.append(row)
                log(f"{target.label} render {length:>6} tok tools={tools!s:5} {row['rps']:8.1f} req/s "
                    f"cpu {row['server_cpu_ms_per_render']} ms/render p50 {row['lat_p50_ms']} ms")
        section["render"] = render_rows

        sweep_payload = bodies.get((args.sweep_prompt_len, True))
        if sweep_payload is None:
            sweep_payload = json.dumps(chat_with_tokens(client, model, args.sweep_prompt_len, True)[0]).encode()
        sweep = []
        for c in args.concurrency_sweep:
            row = asyncio.run(closed_loop(target, RENDER_PATH, sweep_payload, c, args.duration))
            sweep.append({"prompt_tokens_target": args.sweep_prompt_len, "tools": True, **row})
            log(f"{target.label} render c={c:<3} {row['rps']:8.1f} req/s cpu {row['server_cpu_ms_per_render']} "
                f"ms/render cores {row['server_cores_used']} p99 {row['lat_p99_ms']} ms")
        section["concurrency_sweep"] = sweep

        derender_rows = []
        if client.post(DERENDER_PATH, json={}).status_code == 404:  # (vllm-rs: render only)
            section["derender_note"] = "the server has no derender endpoint"
            section["derender"] = derender_rows
            section["recommendation"] = recommendation_for(section, args)
            return section
        for config in args.parser_configs:
            chat = {"model": model, "messages": [{"role": "user", "content": "What's the weather in Seoul?"}]}
            if config == "tools":
                chat["tools"] = SIZING_TOOLS
            if config == "plain":
                chat["chat_template_kwargs"] = {"enable_thinking": False}
            prompt_ids = client.post(RENDER_PATH, json=chat).json()["token_ids"]
            output = stream_output(tokenizer, args.derender_tokens, config)
            derender_stream(client, target, model, chat, prompt_ids, output[:16], 4, "warmup")
            for k in args.chunk_sizes:
                row = repeated_streams(client, target, model, chat, prompt_ids, output, k, f"sizing-{config}-{k}",
                                       min_wall_s=args.duration / 2)
                derender_rows.append({"parser_config": config, **row})
                log(f"{target.label} derender {config:9} chunk={k:<3} cpu {row['server_cpu_ms_per_token']} ms/token "
                    f"{row['request_bytes_per_chunk']:.0f} B up / {row['response_bytes_per_chunk']:.0f} B down "
                    "per chunk")
        section["derender"] = derender_rows
    if args.images_per_render:
        section["images"] = measure_images(target, model, args, log)
    section["recommendation"] = recommendation_for(section, args)
    return section


def measure_images(target: Target, model: str, args, log) -> dict:
    """Renders with ``--images-per-render`` distinct JPEGs of ``--image-resolution`` (never a cache hit) and ~1k
    tokens of text, at ``--render-concurrency`` clients; the server must serve a covered vision-language model."""
    from bench.image_render_bench import Workload, load_run

    workload = Workload(args.images_per_render, args.image_resolution,
                        nonrepetitive_text(random.Random(20261205), 330), args.mm_payload, model)
    with httpx.Client(base_url=target.base_url, timeout=600) as client:
        probe = client.post(RENDER_PATH, content=workload.payload(1), headers={"content-type": "application/json"})
    if probe.status_code != 200:
        raise SystemExit(f"{target.label}: an image render answered {probe.status_code}: {probe.text[:300]}")
    row = asyncio.run(load_run(target.port, workload, args.render_concurrency, args.duration, target.cpu_seconds,
                               [int(time.time() * 1000)], target.host))
    row = {"images_per_render": args.images_per_render, "resolution": args.image_resolution,
           "mm_payload": args.mm_payload, "concurrency": args.render_concurrency, **row}
    log(f"{target.label} images {args.images_per_render}x{args.image_resolution} {row['images_per_s']} img/s "
        f"cpu {row['cpu_ms_per_image']} ms/image p50 {row['p50_ms']} ms")
    return row


def recommendation_for(section: dict, args) -> dict:
    cpu_known = section["render"] and section["render"][0]["server_cpu_ms_per_render"] is not None
    render_key, token_key = ("server_cpu_ms_per_render", "server_cpu_ms_per_token") if cpu_known else \
        ("lat_p50_ms", "wall_ms_per_chunk")
    by_len = {r["prompt_tokens"]: r[render_key] for r in section["render"] if r["tools"] == args.target_tools}
    rows = [r for r in section["derender"] if r["parser_config"] == args.target_parser_config]
    if not by_len or not rows:
        return {"error": "no measurement for the target configuration"}
    row = min(rows, key=lambda r: abs(r["chunk_tokens"] - args.target_chunk_tokens))
    token_ms = row[token_key] if cpu_known else row[token_key] / row["chunk_tokens"]
    images = section.get("images") or {}
    image_ms = (images.get("cpu_ms_per_image") if cpu_known else None) or 0.0
    out = recommend(interpolate(by_len, args.target_prompt_len), token_ms, args.target_render_rps,
                    args.target_streams, args.stream_tokens_per_s, args.headroom, args.workers_per_replica,
                    image_ms, args.images_per_render if images else 0)
    out["basis"] = {"prompt_len": args.target_prompt_len, "tools": args.target_tools,
                    "parser_config": args.target_parser_config, "chunk_tokens": row["chunk_tokens"],
                    "cpu": "server CPU from /proc" if cpu_known else "wall-clock latency (upper bound: no /proc)",
                    "target_render_rps": args.target_render_rps, "target_streams": args.target_streams,
                    "stream_tokens_per_s": args.stream_tokens_per_s, "headroom": args.headroom}
    return out


def format_tables(report: dict) -> str:
    lines = []
    for s in report["servers"]:
        lines.append(f"== {s['label']} ({s['base_url']}, CPU: {s['cpu_source']})")
        lines.append(f"{'render':<10}{'tokens':>8}{'tools':>7}{'req/s':>10}{'cpu ms':>10}{'req/s/core':>11}"
                     f"{'p50 ms':>10}")
        for r in s["render"]:
            lines.append(f"{'':<10}{r['prompt_tokens']:>8}{str(r['tools']):>7}{r['rps']:>10.1f}"
                         f"{str(r['server_cpu_ms_per_render']):>10}{str(r.get('rps_per_core')):>11}"
                         f"{str(r['lat_p50_ms']):>10}")
        lines.append(f"{'derender':<10}{'config':>10}{'chunk':>6}{'cpu ms/tok':>12}{'B up/chunk':>12}"
                     f"{'B down/chunk':>13}")
        for r in s["derender"]:
            lines.append(f"{'':<10}{r['parser_config']:>10}{r['chunk_tokens']:>6}{str(r['server_cpu_ms_per_token']):>12}"
                         f"{r['request_bytes_per_chunk']:>12.0f}{r['response_bytes_per_chunk']:>13.0f}")
        lines.append(f"{'sweep':<10}{'conc':>6}{'req/s':>10}{'cpu ms':>10}{'cores':>8}{'p99 ms':>10}")
        for r in s["concurrency_sweep"]:
            lines.append(f"{'':<10}{r['concurrency']:>6}{r['rps']:>10.1f}{str(r['server_cpu_ms_per_render']):>10}"
                         f"{str(r['server_cores_used']):>8}{str(r['lat_p99_ms']):>10}")
        rec = s["recommendation"]
        if "error" not in rec:
            b = rec["basis"]
            lines.append(f"RECOMMENDATION ({s['label']}): {rec['worker_processes']} worker processes in "
                         f"{rec['replicas']} replica(s) of {rec['workers_per_replica']} for {b['target_render_rps']} "
                         f"renders/s of {b['prompt_len']} tokens (tools={b['tools']}) + {b['target_streams']} parsed "
                         f"streams at {b['stream_tokens_per_s']} tok/s ({b['parser_config']}, "
                         f"chunk {b['chunk_tokens']})"
                         + (f" + {rec['images_per_render']} images per render at {rec['cpu_ms_per_image']} "
                            f"ms each" if rec.get("images_per_render") else "")
                         + f", headroom {b['headroom']}: {rec['render_cores']} + {rec['stream_cores']} + "
                         f"{rec.get('image_cores', 0)} cores, "
                         f"{rec['cores_with_headroom']} with headroom")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"want a comma list of positive integers, got {text!r}")
    return values


def add_parser(sub) -> None:
    import argparse

    def int_list(text: str) -> list[int]:
        try:
            return _int_list(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def configs(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values or any(v not in PARSER_CONFIGS for v in values):
            raise argparse.ArgumentTypeError(f"parser configurations are {', '.join(PARSER_CONFIGS)}")
        return values

    p = sub.add_parser("sizing", help="render-tier sizing: render and derender CPU, concurrency sweep, recommendation")
    p.add_argument("--base-url", action="append", default=[], help="a render server; repeat for several")
    p.add_argument("--label", action="append", default=[], help="one per --base-url (default: host:port)")
    p.add_argument("--server-pid", action="append", type=int, default=[],
                   help="one per --base-url (0: find the processes listening on the port)")
    p.add_argument("--launch", default="", help="comma list of servers to start here first: ours, vllm-rs, vllm "
                                                "(vLLM 0.32's Python render server)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="--launch: serve a copy of the model with this context (for prompts past the model's own)")
    p.add_argument("--workers", type=int, default=2, help="--launch ours: worker processes")
    p.add_argument("--model-dir", default=str(QWEN3_DIR),
                   help="the served model's directory (tokenizer for derender streams; model for --launch)")
    p.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    p.add_argument("--prompt-lens", type=int_list, default=[1024, 4096, 9216, 32768])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per closed-loop render point")
    p.add_argument("--render-concurrency", type=int, default=1, help="clients for the per-length render table")
    p.add_argument("--concurrency-sweep", type=int_list, default=[1, 2, 4, 8])
    p.add_argument("--sweep-prompt-len", type=int, default=4096)
    p.add_argument("--derender-tokens", type=int, default=256, help="tokens per derender stream")
    p.add_argument("--chunk-sizes", type=int_list, default=[1, 4, 16], help="tokens per derender call")
    p.add_argument("--parser-configs", type=configs, default=list(PARSER_CONFIGS))
    p.add_argument("--target-render-rps", type=float, default=100.0)
    p.add_argument("--target-streams", type=int, default=100, help="concurrent parsed streams")
    p.add_argument("--stream-tokens-per-s", type=float, default=30.0, help="tokens/s of each stream")
    p.add_argument("--target-prompt-len", type=int, default=4096)
    p.add_argument("--target-tools", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--target-parser-config", choices=PARSER_CONFIGS, default="tools")
    p.add_argument("--target-chunk-tokens", type=int, default=1, help="tokens per derender call in production")
    p.add_argument("--images-per-render", type=int, default=0,
                   help="also measure renders with this many images (a vision-language server) and size for them")
    p.add_argument("--image-resolution", choices=["480p", "720p", "1080p"], default="720p")
    p.add_argument("--mm-payload", choices=["tensors", "none"], default="tensors",
                   help="image renders with tensors (for an engine) or without (for a router)")
    p.add_argument("--headroom", type=float, default=0.3)
    p.add_argument("--workers-per-replica", type=int, default=4)
    p.add_argument("--output", default=None, help="result JSON (default bench/results/sizing_<UTC>.json)")
    p.set_defaults(func=cmd_sizing)


def cmd_sizing(args, parser) -> int:
    from bench.datasets import load_tokenizer

    if not 0 <= args.headroom < 1:
        parser.error("--headroom must be in [0, 1)")
    launch = [x.strip() for x in args.launch.split(",") if x.strip()]
    if any(x not in ("ours", "vllm", "vllm-rs") for x in launch):
        parser.error("--launch takes ours, vllm-rs and/or vllm")
    if "vllm-rs" in launch and peers.vllm_rs_binary() is None:
        parser.error("--launch vllm-rs: no binary ($SPLITSERVE_VLLM_RS or bench/.peers/vllm-rs)")
    if not args.base_url and not launch:
        parser.error("give --base-url (or --launch ours,vllm)")
    if args.label and len(args.label) != len(args.base_url):
        parser.error("give one --label per --base-url")
    if args.server_pid and len(args.server_pid) != len(args.base_url):
        parser.error("give one --server-pid per --base-url")
    tokenizer = load_tokenizer(args.model_dir)
    try:
        for config in args.parser_configs:
            stream_output(tokenizer, args.derender_tokens, config)
    except ValueError as exc:
        parser.error(str(exc))
    started: list[tuple[str, object]] = []
    targets: list[Target] = []
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    served_dir: Path | None = None
    if launch and args.max_model_len:
        from bench.agent_render_bench import long_context_model

        served_dir = long_context_model(args.max_model_len, Path(args.model_dir))
    model_dir = str(served_dir or args.model_dir)
    try:
        for name in launch:
            port = peers.free_port()
            if name == "ours":
                proc = peers.start_ours(model_dir, port, workers=args.workers, max_model_len=args.max_model_len)
                started.append(("ours", proc))
                pid = proc.pid
            elif name == "vllm-rs":
                rs = peers.start_vllm_rs(peers.vllm_rs_binary(), model_dir, port,  # type: ignore[arg-type]
                                         max_model_len=args.max_model_len)
                started.append(("ours", rs))  # (a Popen, stopped as ours is)
                pid = rs.pid
            else:
                venv = peers.vllm032_venv()
                if venv is None:
                    peers.install_vllm()
                    venv = peers.VLLM_VENV
                pid = peers.start_vllm(model_dir, port, venv=venv)
                started.append(("vllm", pid))
            peers.wait_healthy(f"http://127.0.0.1:{port}", pid)
            label = {"ours": f"ours-{args.workers}w", "vllm-rs": "vllm-rs-0.34"}.get(name, "vllm-0.32")
            targets.append(Target(label, f"http://127.0.0.1:{port}", None if name == "vllm" else pid))
            log(f"# launched {label} on port {port}, CPU of pids {targets[-1].pids}")
        for i, url in enumerate(args.base_url):
            pid = args.server_pid[i] if args.server_pid else None
            targets.append(Target(args.label[i] if args.label else urlparse(url).netloc, url, pid or None))
        report = {"command": "splitserve-bench " + " ".join(args.argv),
                  "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
                  "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "servers": []}
        for target in targets:
            try:
                model = args.model or _first_model(target.base_url)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                parser.error(f"could not list models at {target.base_url}/v1/models ({exc}); pass --model")
            report["servers"].append(measure(target, model, tokenizer, args, log))
        report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        for name, handle in started:
            if name == "ours":
                peers.stop_tree(handle.pid)
                handle.wait(timeout=30)
            else:
                peers.stop_tree(handle)  # start.sh's wrapper: its tree holds the server
        if served_dir is not None:
            import shutil

            shutil.rmtree(served_dir, ignore_errors=True)
    print(format_tables(report), flush=True)
    out = Path(args.output) if args.output else \
        peers.REPO / "bench" / "results" / f"sizing_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report)
    print(f"# wrote {out}", flush=True)
    return 0


def _first_model(base_url: str) -> str:
    response = httpx.get(base_url + "/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


if __name__ == "__main__":
    from bench.cli import main

    sys.exit(main(["sizing", *sys.argv[1:]]))
