"""The gateway's CPU per streamed event against a replayed engine, trees side by side.

``bench/gateway_overhead.py`` measures the gateway against a live engine at concurrency: how many events one
read of an engine connection holds then depends on the engine's pace and the machine's load, and its per-token
figure moves by several us between runs (and between its two gateway slots: a control run with the same tree in
both is in bench/results/gateway_overhead_2core_main_vs_main_control.json). This bench takes the engine out: a
recorded engine stream (``bench/data/engine_stream_qwen3_tiny.json``: the raw HTTP response of our token engine
to the gateway's bench request, tiny random Qwen3, built-in Qwen3 tokenizer, max_tokens 1 and 128) is replayed.

Default mode, real processes: each gateway is the tree's own ``render-service serve --engine URL`` (qwen3
reasoning and hermes tool parsers on, as in gateway_overhead), run with this interpreter from the tree's
directory, and the recording is replayed from this process in lockstep with the client: a stream's next event
is written only once the gateway's bytes for the previous one reached the client (or after ``FALLBACK_S``, when
an event produced none: the last one, whose chunk goes out with usage and [DONE]), so every engine event is one
read and one pass through the pushed path (engine SSE decode, merge, chat responder, SSE relay, uvicorn's
write), the same in every run. ``--pace-ms`` adds an engine step's wait before each next event (the gateway
idles between events, as in production). CPU is the sum of the gateway's threads' run time
(/proc/PID/task/*/schedstat) around each phase: N requests of max_tokens 1, N of 128:

    per_request = CPU(short) / N        per_token = (CPU(long) - CPU(short)) / (N * (T - 1))

``--in-process``: the same events through each tree's code without sockets or servers, in a fresh process per
tree and round: ``EngineEvents`` decoding each chunk as the engine connection's data callback does, then
``SseRelay.on_choice`` (the chat responder's SSE bytes, then an ASGI send that returns at once); CPU per event.

Trees alternate every round; the best (lowest) CPU of each figure over the rounds is reported (this box is
shared: the best is the least disturbed), medians too for the process mode.

    .venv/bin/python -m bench.gateway_event_path --tree earlier=/tmp/earlier --tree main=/tmp/main --tree this=. \\
        --in-process --requests 40 --rounds 7 --out bench/results/gateway_event_path_in_process.json
    .venv/bin/python -m bench.gateway_event_path --tree earlier=/tmp/earlier --tree main=/tmp/main --tree this=. \\
        --requests 16 --concurrency 8 --rounds 7 --pace-ms 2 --thrash-mb 16 \\
        --out bench/results/gateway_event_path_processes_cold.json

(``bench/results/gateway_event_path_*.json`` hold the exact commands; the two trees they name were worktrees
of 1e4ad80 and of main at the commit each file's note names.)

``--record TREE`` records the engine stream again from TREE's token engine (torch, a tiny random model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from bench.gateway_overhead import (
    MESSAGES,
    _split_request,
    cpu_seconds,
    free_port,
    machine,
    start,
    tokenizer_dir,
)
from bench.portable import write_result

ROOT = Path(__file__).resolve().parent.parent
RECORDING = ROOT / "bench/data/engine_stream_qwen3_tiny.json"
FALLBACK_S = 0.02  # an event the gateway wrote nothing for (it may hold bytes): the next one goes after this
BODY_END = b"0\r\n\r\n"
GATEWAY_FLAGS = ["--served-model-name", "bench", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                 "--enable-auto-tool-choice", "--log-level", "warning"]


def chat_body(max_tokens: int) -> bytes:
    return msgspec.json.encode({"model": "bench", "messages": MESSAGES, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}})


# ------------------------------------------------------------------------------------------ recording


def record(engine_tree: Path, tokens: int, out: Path) -> None:
    """The engine's raw response (status line, headers, chunked body) to the gateway's engine request for the
    bench chat request, at max_tokens 1 and ``tokens``."""
    import socket

    from render_service.gateway.flow import engine_request
    from render_service.render.render import render_chat
    from render_service.render.render_config import load_render_config
    from render_service.wire.protocol import ChatCompletionRequest
    from token_engine.models.random_model import write_random_model

    tok_dir, _ = tokenizer_dir(True)
    with tempfile.TemporaryDirectory(prefix="gw-event-rec-") as tmp:
        model = write_random_model(Path(tmp) / "tiny", arch="qwen3", preset="tiny",
                                   overrides={"tie_word_embeddings": False}, tokenizer_dir=tok_dir, dtype="float32")
        config = load_render_config(str(model), served_model_names=["bench"], reasoning_parser="qwen3",
                                    tool_call_parser="hermes", enable_auto_tool_choice=True)
        port = free_port()
        proc = start([sys.executable, "-m", "token_engine.cli", "serve", str(model), "--host", "127.0.0.1", "--port",
                      str(port), "--dtype", "float32", "--max-model-len", str(tokens + 256), "--log-level", "warning"],
                     port, Path(tmp) / "engine.log", cwd=engine_tree)
        try:
            recorded = {}
            for max_tokens in (1, tokens):
                req = msgspec.json.decode(chat_body(max_tokens), type=ChatCompletionRequest)
                body = msgspec.json.encode(engine_request(render_chat(req, config, request_id="chatcmpl-rec")))
                head = (f"POST /inference/v1/generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                        f"\r\naccept: text/event-stream\r\nx-request-id: chatcmpl-rec\r\ncontent-length: {len(body)}"
                        "\r\n\r\n").encode()
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(head + body)
                    data = b""
                    while not data.endswith(BODY_END):
                        got = s.recv(65536)
                        if not got:
                            raise SystemExit("the engine closed the connection mid-response")
                        data += got
                recorded[str(max_tokens)] = data.decode("latin-1")
        finally:
            proc.terminate()
            proc.wait(30)
    out.write_text(json.dumps({"engine_tree": str(engine_tree), "tokens": tokens, "responses": recorded}, indent=1)
                   + "\n")


def frames(response: str) -> tuple[bytes, list[bytes]]:
    """(status line and headers, each chunk of the body with its framing); the [DONE] chunk carries the body's end."""
    raw = response.encode("latin-1")
    end = raw.index(b"\r\n\r\n") + 4
    head, rest, out = raw[:end], raw[end:], []
    while rest:
        size_end = rest.index(b"\r\n")
        size = int(rest[:size_end], 16)
        frame_end = size_end + 2 + size + 2
        out.append(rest[:frame_end])
        rest = rest[frame_end:]
    out[-2:] = [out[-2] + out[-1]]  # [DONE] and the zero-length chunk in one write
    return head, out


# ------------------------------------------------------------------------------------------ replay + client


class Lockstep:
    """What the client has received so far; the replayed engine waits on it."""

    def __init__(self) -> None:
        self.version = 0
        self.changed = asyncio.Event()
        self.fallbacks = 0

    def received(self) -> None:
        self.version += 1
        self.changed.set()

    async def wait_past(self, version: int) -> None:
        while self.version <= version:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), FALLBACK_S)
            except asyncio.TimeoutError:
                self.fallbacks += 1
                return


class ReplayEngine(asyncio.Protocol):
    """A token engine that answers each generate with the recording of its max_tokens, one chunk at a time, in
    step with the client whose X-Request-Id (a key of ``steps``) the rendered request id carries."""

    def __init__(self, recorded: dict[int, tuple[bytes, list[bytes]]], steps: dict[str, Lockstep],
                 pace_s: float = 0.0, thrash: bytes = b"") -> None:
        self.recorded, self.steps, self.pace_s, self.thrash, self.buf = recorded, steps, pace_s, thrash, b""
        self.replaying: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        parts = _split_request(self.buf)
        if parts is None:
            return
        head, body, self.buf = parts
        if not head.startswith(b"POST /inference/v1/generate"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")  # health and the like
            return
        request = msgspec.json.decode(body)
        step = next(step for key, step in self.steps.items() if key in request["request_id"])
        recorded = self.recorded[request["sampling_params"]["max_tokens"]]
        self.replaying = asyncio.get_running_loop().create_task(self.replay(step, *recorded))

    async def replay(self, step: Lockstep, head: bytes, chunks: list[bytes]) -> None:
        self.transport.write(head)
        for chunk in chunks:
            seen = step.version
            self.transport.write(chunk)
            if chunk is not chunks[-1]:
                await step.wait_past(seen)
                if self.thrash:  # what an engine step does to the shared caches: read a buffer larger than them
                    self.thrash.find(b"\x01")
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)


class Client(asyncio.Protocol):
    """One kept-alive connection to the gateway; ``request`` sends a chat request and reads the whole stream."""

    def __init__(self, step: Lockstep, request_id: str) -> None:
        self.step, self.buf, self.request_id = step, b"", request_id.encode()
        self.done: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.step.received()
        if self.buf.endswith(BODY_END) and self.done is not None and not self.done.done():
            self.done.set_result(self.buf)

    async def request(self, body: bytes) -> bytes:
        self.buf, self.done = b"", asyncio.get_running_loop().create_future()
        self.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json"
                             b"\r\nx-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (self.request_id, len(body))
                             + body)
        response = await self.done
        if not response.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"gateway answered {response[:300]!r}")
        return response


async def phase(port: int, steps: dict[str, Lockstep], n: int, concurrency: int, max_tokens: int, pid: int) -> dict:
    """``n`` requests over ``concurrency`` kept-alive connections, each in step with its own engine stream."""
    loop = asyncio.get_running_loop()
    clients = []
    for k in range(concurrency):
        key = f"gwbench{k}x"  # the x: no key is the prefix of another
        steps[key] = Lockstep()
        clients.append((await loop.create_connection(partial(Client, steps[key], key), "127.0.0.1", port))[1])
    body = chat_body(max_tokens)
    events, left = 0, n

    async def worker(client: Client) -> None:
        nonlocal events, left
        while left > 0:
            left -= 1
            got = (await client.request(body)).count(b"data: ")
            events += got  # (not `events += await ...`: that reads events before the await)

    try:
        await asyncio.gather(*(c.request(body) for c in clients))  # each connection's first request, not measured
        fallbacks = sum(s.fallbacks for s in steps.values())
        before, started = cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker(c) for c in clients))
        wall, cpu = time.perf_counter() - started, cpu_seconds(pid) - before
    finally:
        for c in clients:
            c.transport.close()
    return {"max_tokens": max_tokens, "cpu_s": round(cpu, 5), "wall_s": round(wall, 3),
            "events_per_request": round(events / n, 2),
            "fallbacks": sum(s.fallbacks for s in steps.values()) - fallbacks}


async def run(trees: dict[str, Path], recorded: dict[int, tuple[bytes, list[bytes]]], n: int, concurrency: int,
              rounds: int, logs: Path, model: Path, pace_s: float, thrash_mb: int) -> dict[str, list[dict]]:
    loop = asyncio.get_running_loop()
    steps: dict[str, Lockstep] = {}
    thrash = bytes(thrash_mb << 20)
    server = await loop.create_server(partial(ReplayEngine, recorded, steps, pace_s, thrash), "127.0.0.1", 0)
    engine_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name, tree in trees.items():
            port = free_port()
            argv = [sys.executable, "-m", "render_service.cli", "serve", str(model), "--host", "127.0.0.1",
                    "--port", str(port), *GATEWAY_FLAGS, "--engine", engine_url]
            procs[name] = (await asyncio.to_thread(start, argv, port, logs / f"gateway_event_path_{name}.log", tree),
                           port)
        long_tokens = max(recorded)
        for proc, port in procs.values():  # warm: imports, pipelines, the engine connection
            await phase(port, steps, 2 * concurrency, concurrency, long_tokens, proc.pid)
        out: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(rounds):
            order = list(procs) if r % 2 == 0 else list(procs)[::-1]
            for name in order:
                proc, port = procs[name]
                short = await phase(port, steps, n, concurrency, 1, proc.pid)
                long = await phase(port, steps, n, concurrency, long_tokens, proc.pid)
                out[name].append({"short": short, "long": long, **per_unit(short["cpu_s"], long["cpu_s"], n,
                                                                            long_tokens)})
                print(name, json.dumps(out[name][-1]), flush=True)
        return out
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.close()


def per_unit(short_cpu_s: float, long_cpu_s: float, n: int, tokens: int) -> dict:
    return {"per_request_us": round(short_cpu_s / n * 1e6, 1),
            "per_token_us": round((long_cpu_s - short_cpu_s) / (n * (tokens - 1)) * 1e6, 2)}


def summarise(runs: dict[str, list[dict]], n: int, tokens: int) -> dict:
    best = {name: per_unit(min(r["short"]["cpu_s"] for r in rs), min(r["long"]["cpu_s"] for r in rs), n, tokens)
            for name, rs in runs.items()}
    median = {name: {k: round(statistics.median(r[k] for r in rs), 2) for k in ("per_request_us", "per_token_us")}
              for name, rs in runs.items()}
    first = next(iter(runs))
    return {"best": best, "median": median,
            f"per_token_over_{first}": {name: {"best": round(best[name]["per_token_us"] / best[first]["per_token_us"],
                                                             3),
                                               "median": round(median[name]["per_token_us"]
                                                               / median[first]["per_token_us"], 3)}
                                        for name in runs}}


# ------------------------------------------------------------------------------------------ in-process


def in_process_per_event(model_dir: str, recording: str, requests: int) -> dict:
    """The same recorded events through this interpreter's ``render_service`` without sockets: each engine chunk
    decoded as the engine connection's data callback does (``EngineEvents``), its choice handed to the SSE relay
    (``SseRelay.on_choice``: the chat responder's bytes, then the ASGI send, here one that returns at once).
    CPU per event, over ``requests`` streams (a fresh responder and relay each), and the stage alone."""
    import render_service
    from render_service.gateway.engine_client import EngineEvents
    from render_service.gateway.responses import ChatResponder
    from render_service.gateway.sse_relay import SseRelay
    from render_service.render.render import render_chat
    from render_service.wire.protocol import ChatCompletionRequest

    try:
        from render_service.render.render_config import load_render_config
    except ImportError:  # older trees
        from render_service.render.render import load_render_config  # type: ignore[attr-defined,no-redef]

    config = load_render_config(model_dir, served_model_names=["bench"], reasoning_parser="qwen3",
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    req = msgspec.json.decode(chat_body(128), type=ChatCompletionRequest)
    saved = json.loads(Path(recording).read_text())
    _, chunks = frames(saved["responses"][str(max(int(k) for k in saved["responses"]))])
    # what the HTTP/1.1 reader hands EngineEvents: each chunk's payload, without its framing
    pieces = [c.split(b"\r\n", 1)[1][:-2] for c in chunks[:-1]]

    async def send(message: dict) -> None:
        return None

    def one_stream(relay: bool) -> None:
        responder = ChatResponder(render_chat(req, config, request_id="chatcmpl-bench"), req, config)
        events = EngineEvents("http://engine", None)  # type: ignore[arg-type]  # no reads: fed below
        out = SseRelay(None, None, None, responder)  # type: ignore[arg-type]  # only the write path runs
        out._send = send
        for piece in pieces:
            for event in events._decode([piece]):
                for choice in event.choices:
                    if relay:
                        out.on_choice(0, choice)
                    else:
                        responder.stream_events(0, choice)

    def timed(fn: Any) -> float:
        t0 = time.process_time()
        for _ in range(requests):
            fn()
        return round(1e6 * (time.process_time() - t0) / (requests * len(pieces)), 3)

    async def measure() -> dict:
        one_stream(True)  # warm
        return {"decode_us_per_event": timed(lambda: [EngineEvents("http://engine", None)._decode([p])  # type: ignore[arg-type]
                                                       for p in pieces]),
                "decode_and_responder_us_per_event": timed(lambda: one_stream(False)),
                "decode_responder_relay_us_per_event": timed(lambda: one_stream(True))}

    out = asyncio.run(measure())
    out["render_service"] = str(Path(render_service.__file__).parent)
    return out


_CHILD = """
import json, sys, importlib.util
sys.path.insert(0, sys.argv[6])
import bench.gateway_overhead  # this tree's bench, before the measured tree takes its place on the path
sys.path[0] = sys.argv[1]
spec = importlib.util.spec_from_file_location("gateway_event_path_child", sys.argv[2])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
print(json.dumps(bench.in_process_per_event(sys.argv[3], sys.argv[4], int(sys.argv[5]))))
"""


def compare_in_process(trees: dict[str, Path], model: Path, recording: str, requests: int, rounds: int) -> dict:
    """Each tree in a fresh process per round, alternated; the best (lowest) of each figure wins."""
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            done = subprocess.run([sys.executable, "-c", _CHILD, str(trees[name]), __file__, str(model), recording,
                                   str(requests), str(ROOT)], check=True, capture_output=True, text=True,
                                  cwd=str(trees[name]))
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(name, json.dumps(runs[name][-1]), flush=True)
    keys = [k for k in runs[next(iter(trees))][0] if k.endswith("_us_per_event")]
    best = {name: {k: min(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    first = next(iter(trees))
    return {"best": best, f"over_{first}": {name: {k: round(best[name][k] / best[first][k], 3) for k in keys}
                                            for name in trees}, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a checkout whose gateway to measure (repeat; the first is the baseline of the ratios)")
    ap.add_argument("--requests", type=int, default=16, help="requests per phase")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (each stream in its own step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pace-ms", type=float, default=0.0,
                    help="also wait this long before each next event (an engine's decode step: the gateway idles "
                         "between events, as it does in production, instead of running hot)")
    ap.add_argument("--thrash-mb", type=int, default=0,
                    help="and read a buffer this large before each next event (evicts the shared caches, as the "
                         "engine's step does: each event starts cold)")
    ap.add_argument("--in-process", action="store_true",
                    help="time the per-event path in-process instead (no servers): --requests streams per figure")
    ap.add_argument("--recording", default=str(RECORDING))
    ap.add_argument("--record", metavar="ENGINE_TREE", help="record the engine stream from this tree's engine, exit")
    ap.add_argument("--record-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--note", default="", help="stored with the results (e.g. how loaded the machine was)")
    a = ap.parse_args(argv)
    if a.record:
        record(Path(a.record).resolve(), a.record_tokens, Path(a.recording))
        return 0
    trees = {name: Path(path).resolve() for name, _, path in (t.partition("=") for t in a.tree)} or {"this": ROOT}
    saved = json.loads(Path(a.recording).read_text())
    recorded = {int(k): frames(v) for k, v in saved["responses"].items()}
    tokens = max(recorded)
    info = machine()
    # the gateway reads the model's config and tokenizer
    from token_engine.models.random_model import write_random_model

    with tempfile.TemporaryDirectory(prefix="gw-event-") as tmp:
        model = write_random_model(Path(tmp) / "tiny", arch="qwen3", preset="tiny",
                                   overrides={"tie_word_embeddings": False}, tokenizer_dir=tokenizer_dir(True)[0],
                                   dtype="float32")
        if a.in_process:
            figures = compare_in_process(trees, model, a.recording, a.requests, a.rounds)
        else:
            runs = asyncio.run(run(trees, recorded, a.requests, a.concurrency, a.rounds, Path(a.logs), model,
                                   a.pace_ms / 1e3, a.thrash_mb))
            figures = {**summarise(runs, a.requests, tokens), "runs": runs}
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    setup: dict[str, Any] = {"requests": a.requests, "rounds": a.rounds, "tokens": tokens,
                             "recording": Path(a.recording).name, "recorded_from": saved.get("engine_tree"),
                             "trees": {k: str(v) for k, v in trees.items()}}
    if a.in_process:
        setup["mode"] = "in-process: EngineEvents decode, chat responder, SseRelay write (an ASGI send that returns)"
    else:
        setup.update(mode="gateway processes, replayed engine in lockstep", concurrency=a.concurrency,
                     pace_ms=a.pace_ms, thrash_mb=a.thrash_mb, lockstep_fallback_s=FALLBACK_S)
    result = {"bench": "gateway_event_path", "command": "python -m bench.gateway_event_path " + shlex.join(
        sys.argv[1:] if argv is None else argv), "machine": info, "note": a.note, "setup": setup, **figures}
    print(json.dumps({k: result[k] for k in result if k not in ("runs", "machine")}, indent=1))
    if a.out:
        write_result(Path(a.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
