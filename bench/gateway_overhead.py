"""Gateway CPU overhead: the same streamed requests sent to the engine directly, through a bare relay, and
through the gateway.

One tiny random-weight Qwen3 engine process (real Qwen3 tokenizer, so the text is real byte-level
detokenization), one gateway process (`render-service serve --engine URL`, qwen3 reasoning parser and
hermes tool parser on, as deployed) and two relay processes that give the floor on this machine:

* ``floor``: raw asyncio protocols on uvloop, as lean as a relay gets: the client's body is forwarded as
  is to a kept-alive engine connection and every read of the engine's body is written to the client,
  unparsed (one read and one write syscall per engine event, in one callback);
* ``floor_streams``: the same with asyncio streams and one task per request (what any ASGI server does:
  the engine read wakes a task, which writes).

Each phase sends the same N requests at concurrency C (chat requests to the gateway; the rendered token
IDs, from the gateway's own /render, to the engine and the relays). CPU of each server process is the
sum of its threads' run time from /proc/PID/task/*/schedstat (nanoseconds; other load on the machine
does not count), taken around each phase. Two output lengths (max_tokens 1 and T, ignore_eos) separate
the per-request cost (HTTP in, render, routing, the engine call, the first and last chunks) from the
per-token cost (engine SSE in, derender, OpenAI SSE out):

    per_request = CPU(short) / N
    per_token   = (CPU(long) - CPU(short)) / (N * (T - 1))

each less the process's idle CPU rate (measured while the other phases run) times the phase's wall
time. ``--rounds R`` repeats every phase R times, alternated, and reports medians: this box is noisy.
``--compare-tree DIR`` also serves the gateway from another checkout (e.g. ``git worktree add
/tmp/gw_before HEAD``), alternated with this one in the same run, for before/after figures.

The bench also times the gateway's own per-request and per-token work in-process (no HTTP).

It needs only the packages of the project (torch for the engine) and finds the tokenizer in
``$SPLITSERVE_FIXTURES/qwen3-0.6b``, else the shared fixtures beside the checkout, else the built-in
default bundle (render_service/bundle/default_bundle.py):

    .venv/bin/python -m bench.gateway_overhead --requests 64 --tokens 32 --concurrency 8 --rounds 3

Results: bench/results/gateway_overhead.json (targets: <= 1 ms per request, <= 50 us per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that answers briefly."},
    {"role": "user", "content": "Tell me about the weather in Paris and what to wear today."},
]


def tokenizer_dir(builtin: bool = False) -> tuple[Path, str]:
    """(directory with tokenizer.json + tokenizer_config.json, where it came from)."""
    for path in [] if builtin else [QWEN3_DIR]:
        if (path / "tokenizer.json").exists():
            return path, str(path)
    from render_service.bundle.default_bundle import default_bundle_dir

    return default_bundle_dir(), "built-in default bundle (Qwen3 tokenizer, our template)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """Run time of every thread of one process: schedstat (ns), else utime + stime (clock ticks)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
        if total:
            return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"cpus": os.cpu_count(), "usable_cpus": usable, "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def start(argv: list[str], port: int, log_path: Path, cwd: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # cwd decides which checkout's code a server runs (--compare-tree)
    log = open(log_path, "wb")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log, cwd=cwd)
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
            proc.terminate()
            raise SystemExit(f"server on port {port} did not come up")
        time.sleep(0.2)


def _siblings(cpu: int) -> set[int]:
    """The hardware threads sharing ``cpu``'s core (itself included), from sysfs; empty if unknown."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return set()
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_processes(procs: dict[str, subprocess.Popen], pin: bool | None) -> dict[str, int] | None:
    """One core per server process (every thread) and one for this client, so that they do not share a
    core's caches or time with each other; None when not pinned."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if pin is None:
        pin = len(cores) >= 8
    if not pin or len(cores) < len(procs) + 1:
        return None
    # One hardware thread per physical core (its SMT sibling left idle), core 0 last (interrupts, the OS).
    physical = [c for c in cores if c == min(_siblings(c), default=c)]
    spread = [c for c in physical if c != 0] + [c for c in cores if c not in physical and c != 0] + [0]
    chosen = dict(zip([*procs, "client"], spread))
    for name, proc in procs.items():
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), {chosen[name]})
    os.sched_setaffinity(0, {chosen["client"]})
    return chosen


# ------------------------------------------------------------------------------------------ the floor


RELAY_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY_END = b"0\r\n\r\n"


def _request_head(body: bytes) -> bytes:
    return (b"POST /inference/v1/generate HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _split_request(buf: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(request line + headers, body, rest) once a whole request with a Content-Length body is in."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    length = _content_length(buf[:end])
    if len(buf) < end + 4 + length:
        return None
    return buf[:end], buf[end + 4:end + 4 + length], buf[end + 4 + length:]


async def serve_floor(port: int, engine_port: int) -> None:
    """Protocol callbacks only: engine bytes are written to the client inside the engine's data_received."""
    loop = asyncio.get_running_loop()
    idle: list[EngineSide] = []

    class EngineSide(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.client = None

        def begin(self, client: ClientSide, body: bytes) -> None:
            self.client, self.body, self.head, self.buf, self.tail = client, body, True, b"", b""
            self.transport.write(_request_head(body) + body)

        def data_received(self, data: bytes) -> None:
            if self.head:  # the engine's status line and headers are dropped; ours went out instead
                self.buf += data
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                data, self.head, self.buf = RELAY_HEAD + self.buf[end + 4:], False, b""
            self.client.transport.write(data)
            self.tail = (self.tail + data)[-5:]
            if self.tail == BODY_END:
                self.client = None
                idle.append(self)

        def connection_lost(self, exc):
            if self in idle:
                idle.remove(self)
            if self.client is not None:  # the engine closed a kept-alive connection as we reused it
                if self.head:
                    loop.create_task(self.client._connect(self.body))
                else:
                    self.client.transport.close()

    class ClientSide(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            parts = _split_request(self.buf)
            if parts is None:
                return
            head, body, self.buf = parts
            if head.startswith(b"GET"):
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            elif idle:
                idle.pop().begin(self, body)
            else:
                loop.create_task(self._connect(body))

        async def _connect(self, body: bytes) -> None:
            _, engine = await loop.create_connection(EngineSide, "127.0.0.1", engine_port)
            engine.begin(self, body)

    server = await loop.create_server(ClientSide, "127.0.0.1", port)
    await server.serve_forever()


async def serve_floor_streams(port: int, engine_port: int) -> None:
    """asyncio streams and a task per request: the engine read wakes the task, which writes."""
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _content_length(head)
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                while idle and idle[-1][0].at_eof():  # the engine closes idle connections after 5 s
                    idle.pop()[1].close()
                for attempt in range(2):  # a reused connection may have been closed by the engine meanwhile
                    reused = bool(idle) and attempt == 0
                    ereader, ewriter = idle.pop() if reused else await asyncio.open_connection("127.0.0.1",
                                                                                                 engine_port)
                    ewriter.write(_request_head(body) + body)
                    try:
                        await ereader.readuntil(b"\r\n\r\n")
                        break
                    except (asyncio.IncompleteReadError, ConnectionError):
                        ewriter.close()
                        if not reused:
                            raise
                first, tail = True, b""
                while tail != BODY_END:
                    data = await ereader.read(65536)
                    writer.write(RELAY_HEAD + data if first else data)
                    first, tail = False, (tail + data)[-5:]
                idle.append((ereader, ewriter))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    await server.serve_forever()


def run_relay(kind: str, port: int, engine_port: int) -> None:
    import uvloop

    serve = serve_floor if kind == "floor" else serve_floor_streams
    uvloop.run(serve(port, engine_port))


# ------------------------------------------------------------------------------------------ the client


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


# The same conversation in each API's request (ignore_eos: vLLM's extension, accepted by all three here).
API_TARGETS = {"gateway_responses": "responses", "gateway_messages": "messages"}


def gateway_request(api: str, max_tokens: int) -> tuple[str, dict]:
    if api == "responses":
        return "/v1/responses", {"model": "bench", "input": MESSAGES, "max_output_tokens": max_tokens,
                                 "temperature": 0.0, "ignore_eos": True, "stream": True, "store": False}
    if api == "messages":
        return "/v1/messages", {"model": "bench", "system": MESSAGES[0]["content"], "messages": MESSAGES[1:],
                                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "thinking": {"type": "adaptive"}}
    return "/v1/chat/completions", {"model": "bench", "messages": MESSAGES, "max_tokens": max_tokens,
                                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}}


def process_of(target: str) -> str:
    """The server process a target's requests run in (the API targets are the chat gateway's process)."""
    return "gateway" if target in API_TARGETS else target


async def stream_gateway(client: httpx.AsyncClient, url: str, max_tokens: int, api: str = "chat") -> int:
    path, body = gateway_request(api, max_tokens)
    events = 0
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if '"error"' in line[:30]:
                    raise RuntimeError(line)
    return events


async def run_phase(url: str, chat: bool, n: int, concurrency: int, max_tokens: int,
                    token_ids: list[int], api: str = "chat") -> tuple[float, int]:
    """(wall seconds, data events the client received)."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        queue = list(range(n))
        events = 0

        async def worker() -> None:
            nonlocal events
            while queue:
                queue.pop()
                if chat:
                    got = await stream_gateway(client, url, max_tokens, api)
                else:
                    got = await stream_direct(client, url, token_ids, max_tokens)
                events += got  # (not `events += await ...`: that reads events before the await)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, events


def measure(target: str, url: str, n: int, concurrency: int, max_tokens: int, procs: dict,
            token_ids: list[int]) -> dict:
    before = {name: cpu_seconds(p.pid) for name, p in procs.items()}
    try:
        wall, events = asyncio.run(run_phase(url, target.startswith("gateway"), n, concurrency, max_tokens,
                                             token_ids, API_TARGETS.get(target, "chat")))
    except Exception as exc:
        raise SystemExit(f"{target} (max_tokens {max_tokens}) failed: {type(exc).__name__}: {exc}") from exc
    after = {name: cpu_seconds(p.pid) for name, p in procs.items()}
    # Events per request: the engine sends one per token (plus none for [DONE]); the gateway one per token
    # plus its role and usage chunks, fewer when it coalesced events it fell behind on.
    return {"target": target, "max_tokens": max_tokens, "requests": n, "wall_s": round(wall, 3),
            "events_per_request": round(events / n, 2),
            "cpu_s": {name: round(after[name] - before[name], 4) for name in procs}}


def overhead(phases: list[dict], target: str, n: int, t: int) -> dict:
    """Per-request and per-token CPU of the process serving ``target``, from one round's phases."""
    by = {(p["target"], p["max_tokens"]): p for p in phases}
    proc = process_of(target)
    others = [p for p in phases if process_of(p["target"]) != proc]  # phases that leave this process idle
    idle_rate = sum(p["cpu_s"][proc] for p in others) / sum(p["wall_s"] for p in others)
    short = by[(target, 1)]["cpu_s"][proc] - idle_rate * by[(target, 1)]["wall_s"]
    long = by[(target, t)]["cpu_s"][proc] - idle_rate * by[(target, t)]["wall_s"]
    return {"per_request_us": round(short / n * 1e6, 1), "per_token_us": round((long - short) / (n * (t - 1)) * 1e6, 1),
            "idle_cpu_per_s": round(idle_rate, 5)}


# ------------------------------------------------------------------------------------------ in-process


def in_process_costs(model_dir: Path, samples: int = 300, tokens: int = 2000) -> dict:
    """The gateway's own work without any HTTP, CPU time of this process: per request (JSON decode of the
    chat request, render, the engine request's bytes, the responder and its first and last chunks) and
    per token (engine event decode, derender pipeline, chunk building and encoding)."""
    import random

    import msgspec

    from render_service.gateway.flow import engine_request
    from render_service.gateway.responses import ChatResponder
    from render_service.render.render import render_chat
    from render_service.render.render_config import load_render_config
    from render_service.wire.protocol import ChatCompletionRequest, GenerateStreamChoice, GenerateStreamResponse

    config = load_render_config(str(model_dir), served_model_names=["bench"], reasoning_parser="qwen3",
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = msgspec.json.encode({"model": "bench", "messages": MESSAGES, "max_tokens": tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    decode_request = msgspec.json.Decoder(ChatCompletionRequest).decode
    encode = msgspec.json.Encoder().encode

    def timed(fn) -> float:
        started = time.process_time()
        for _ in range(samples):
            fn()
        return round((time.process_time() - started) / samples * 1e6, 1)

    req = decode_request(body)
    gen = render_chat(req, config)
    first = GenerateStreamChoice(index=0, token_ids=[9707], finish_reason=None)
    last = GenerateStreamChoice(index=0, token_ids=[13], finish_reason="length")

    def respond_short() -> None:
        responder = ChatResponder(gen, req, config)
        responder.stream_events(0, first)
        responder.stream_events(0, last)
        responder.usage_chunk()

    per_request = {
        "decode_chat_request_us": timed(lambda: decode_request(body)),
        "render_chat_us": timed(lambda: render_chat(req, config)),
        "engine_request_bytes_us": timed(lambda: encode(engine_request(gen))),
        "responder_first_and_last_chunks_us": timed(respond_short),
    }
    rnd = random.Random(0)
    events = [msgspec.json.encode({"request_id": "x", "choices": [{"index": 0, "token_ids": [rnd.randrange(150000)],
                                                                     "finish_reason": None}]}) for _ in range(tokens)]
    decode_event = msgspec.json.Decoder(GenerateStreamResponse).decode
    def per_token(responder) -> float:
        started = time.process_time()
        for raw in events:
            for choice in decode_event(raw).choices:
                responder.stream_events(0, choice)
        return round((time.process_time() - started) / tokens * 1e6, 1)

    from render_service.apis.messages import render_messages
    from render_service.apis.messages_protocol import MessagesRequest
    from render_service.apis.responses import render_responses
    from render_service.apis.responses_output import ResponsesShape
    from render_service.apis.responses_protocol import ResponsesRequest
    from render_service.gateway.api_responders import MessagesResponder, ResponsesResponder

    _, rbody = gateway_request("responses", tokens)
    rreq = msgspec.convert(rbody, ResponsesRequest)
    rgen, rchat = render_responses(rreq, config, stateless=False)
    _, mbody = gateway_request("messages", tokens)
    mreq = msgspec.convert(mbody, MessagesRequest)
    mgen, mchat = render_messages(mreq, config)
    apis = {
        "chat": per_token(ChatResponder(gen, req, config)),
        "responses": per_token(ResponsesResponder(config, rgen, rchat, ResponsesShape(
            rgen.request_id or "", "bench", rreq, len(rgen.token_ids)))),
        "messages": per_token(MessagesResponder(config, mgen, mchat, "bench")),
    }
    return {"per_request": per_request, "derender_and_encode_us_per_token": apis["chat"],
            "derender_and_encode_us_per_token_by_api": apis,
            "api_over_chat_in_process": {k: round(v / apis["chat"], 2) for k, v in apis.items()}}


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of the long phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every phase, alternated; medians reported")
    ap.add_argument("--compare-tree", default=None, help="also serve the gateway from this checkout (before/after)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/gateway_overhead.json"))
    ap.add_argument("--logs", default=tempfile.gettempdir(), help="where the servers' logs go")
    ap.add_argument("--builtin-bundle", action="store_true",
                    help="use the built-in default bundle's tokenizer and template even where fixtures exist")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="give the engine, each server and this client a core of their own (default: when the "
                         "machine has 8 or more usable cores)")
    ap.add_argument("--serve-relay", nargs=3, metavar=("KIND", "PORT", "ENGINE_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_relay:
        kind, port, engine_port = args.serve_relay
        run_relay(kind, int(port), int(engine_port))
        return 0
    sys.path.insert(0, str(ROOT))
    from token_engine.models.random_model import write_random_model

    info = machine()
    tok_dir, tok_source = tokenizer_dir(args.builtin_bundle)
    logs = Path(args.logs)
    n, t = args.requests, args.tokens
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        model = write_random_model(Path(tmp) / "tiny", arch="qwen3", preset="tiny",
                                   overrides={"tie_word_embeddings": False}, tokenizer_dir=tok_dir, dtype="float32")
        try:
            engine_port = free_port()
            procs["engine"] = start([sys.executable, "-m", "token_engine.cli", "serve", str(model), "--host",
                                     "127.0.0.1", "--port", str(engine_port), "--dtype", "float32", "--max-model-len",
                                     str(64 + t + 256), "--max-num-seqs", str(max(args.concurrency, 8)),
                                     "--log-level", "warning"], engine_port, logs / "engine.log")
            urls = {"direct": f"http://127.0.0.1:{engine_port}"}
            gateways = {"gateway": ROOT}
            if args.compare_tree:
                gateways["gateway_before"] = Path(args.compare_tree).resolve()
            for name, tree in gateways.items():
                port = free_port()
                procs[name] = start([sys.executable, "-m", "render_service.cli", "serve", str(model), "--host",
                                     "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
                                     "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                     "--enable-auto-tool-choice", "--log-level", "warning", "--engine",
                                     urls["direct"]], port, logs / f"{name}.log", cwd=tree)
                urls[name] = f"http://127.0.0.1:{port}"
            for kind in ("floor", "floor_streams"):
                port = free_port()
                procs[kind] = start([sys.executable, "-m", "bench.gateway_overhead", "--serve-relay", kind, str(port),
                                     str(engine_port)], port, logs / f"{kind}.log")
                urls[kind] = f"http://127.0.0.1:{port}"
            pinned = pin_processes(procs, args.pin)
            rendered = httpx.post(urls["gateway"] + "/v1/chat/completions/render",
                                  json={"model": "bench", "messages": MESSAGES}, timeout=60).json()
            token_ids = rendered["token_ids"]
            for name in API_TARGETS:  # Responses and Messages, served by the same gateway process as chat
                urls[name] = urls["gateway"]
            targets = list(urls)
            for target in targets:  # warm every path (imports, pipelines, connection pools)
                measure(target, urls[target], 2 * args.concurrency, args.concurrency, 8, procs, token_ids)
            in_process = in_process_costs(model)
            rounds = []
            for r in range(args.rounds):
                phases = []
                order = targets if r % 2 == 0 else targets[::-1]
                for max_tokens in (1, t):
                    for target in order:
                        phases.append(measure(target, urls[target], n, args.concurrency, max_tokens, procs, token_ids))
                        print(json.dumps(phases[-1]), flush=True)
                rounds.append(phases)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()

    servers = [s for s in targets if s != "direct"]
    per_round = {s: [overhead(phases, s, n, t) for phases in rounds] for s in servers}
    median = {s: {k: round(statistics.median(o[k] for o in per_round[s]), 1)
                  for k in ("per_request_us", "per_token_us")} for s in servers}
    gw = median["gateway"]
    result = {
        "bench": "gateway_overhead",
        "command": " ".join(["python -m bench.gateway_overhead", *sys.argv[1:]]),
        "machine": {**info, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "setup": {"requests": n, "tokens": t, "concurrency": args.concurrency, "rounds": args.rounds,
                  "prompt_tokens": len(token_ids), "tokenizer": tok_source,
                  "model": "tiny random Qwen3, CPU engine", "parsers": "qwen3 + hermes",
                  "compare_tree": args.compare_tree, "pinned_cores": pinned},
        "median": median,
        "gateway_cpu_per_request_us": gw["per_request_us"],
        "gateway_cpu_per_token_us": gw["per_token_us"],
        "gateway_over_floor": {
            floor: {k: round(gw[k] / median[floor][k], 2) if median[floor][k] > 0 else None
                    for k in ("per_request_us", "per_token_us")} for floor in ("floor", "floor_streams")},
        "targets": {"per_request_us": 1000, "per_token_us": 50},
        "meets_targets": gw["per_request_us"] <= 1000 and gw["per_token_us"] <= 50,
        "in_process": in_process,
        # Responses and Messages against chat, the same gateway process and engine, in this run (target <= 1.3)
        "api_over_chat_per_token": {api: round(median[name]["per_token_us"] / gw["per_token_us"], 2)
                                    for name, api in API_TARGETS.items()} if gw["per_token_us"] > 0 else None,
        "api_over_chat_per_request": {api: round(median[name]["per_request_us"] / gw["per_request_us"], 2)
                                      for name, api in API_TARGETS.items()} if gw["per_request_us"] > 0 else None,
        "per_round": per_round,
        "phases": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result)
    print(json.dumps({k: result[k] for k in ("median", "gateway_over_floor", "meets_targets", "api_over_chat_per_token",
                                             "api_over_chat_per_request")}, indent=2))
    print(json.dumps(result["in_process"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
