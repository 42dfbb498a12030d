"""Streaming derender benchmark: our render server vs vLLM 0.32's render server, side by side in one run.

Each stream is an N-token output (reasoning, ``</think>``, content, one ``<tool_call>``, ``<|im_end|>``)
built with the real Qwen3 tokenizer, fed one token per call to ``POST /v1/chat/completions/derender``
(stream=true) with the qwen3 reasoning parser and the hermes tool parser, echoing ``stream_state`` the
way a client does. Per stream we record the server's CPU time (utime+stime of the server process tree
from /proc, so the load of other processes on the machine does not count), the bytes the client
uploaded, the first and last request sizes, and check the reassembled stream against the same server's
batch derender. The growth exponent is the least-squares slope of log(server CPU) over log(N).

Also measured in-process (no HTTP): the pipeline's CPU per token, and the streaming derender handler's
CPU per chunk.

    .venv/bin/python -m bench.derender_bench --tokens 500,1000,2000,4000 --vllm-tokens 500,1000,2000

vLLM is started with the peer recipe's start.sh ($SPLITSERVE_VLLM_PEER_DIR) from ``--vllm-venv`` (bench/.peers/vllm);
``--vllm-tokens ""`` skips it. vLLM points not measured are extrapolated with its measured exponent and
marked ``"extrapolated": true``. Results: bench/results/derender_bench.json.

Before/after a change, in-process only (no servers), this tree against another checkout measured alternately in
fresh processes (the same bench code, the other tree's ``render_service``), ratios of the best of each:

    .venv/bin/python -m bench.derender_bench --baseline-tree /tmp/main-checkout --rounds 5 \
        --out bench/results/derender_bench_vs_main.json

Besides the reasoning + content + call stream above, that mode also times an arguments-heavy stream (a hermes
call whose string argument is most of the output), where the tool parser does nearly all the work, the same
streaming handler with every chunk carrying its token's logprobs (5 alternatives), and the gateway's per-event work
without HTTP (an engine event decoded, the chat responder's SSE bytes), without and with logprobs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR, SHARED

ROOT = Path(__file__).resolve().parent.parent
QWEN = QWEN3_DIR
PEER = SHARED / "peers/vllm-render"
MODEL = "qwen3-0.6b"
CLK = os.sysconf("SC_CLK_TCK")
LOGPROBS_TOP = 5  # alternatives per token in the logprobs measurements

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "note": {"type": "string"}}, "required": ["city"]}}},
]
REASONING = ("I need the weather for Seoul, so the get_weather tool is the right call; I will pass the city "
             "and the unit and then summarise humidity, wind and rain chances in plain words. ")
CONTENT = ("The forecast for Seoul: clear skies in the morning, clouds after noon, 21°C at the warmest and "
           "a light north-west breeze. Rain is unlikely before Friday. ")


# ------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_s(pid: int) -> float:
    """utime+stime of ``pid`` and its live descendants, in seconds."""
    parents: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        stats[int(entry)] = fields
        parents.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += int(stats[p][11]) + int(stats[p][12])
        todo.extend(parents.get(p, []))
    return total / CLK


def fit_exponent(ns: list[int], ys: list[float]) -> float:
    xs = [math.log(n) for n in ns]
    ls = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(xs) / len(xs), sum(ls) / len(ls)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ls)) / sum((x - mx) ** 2 for x in xs)


def wait_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server at {base} exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {base} not healthy after {timeout_s}s")


def pid_of_port(port: int) -> int | None:
    """The process listening on 127.0.0.1:port (vLLM's start.sh prints a wrapper's pid)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[1].endswith(f":{port:04X}") and parts[3] == "0A":
            inode = parts[9]
            break
    if inode is None:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == f"socket:[{inode}]":
                    return int(entry)
        except OSError:
            continue
    return None


class Server:
    def __init__(self, name: str, base: str, pid: int, proc: subprocess.Popen | None):
        self.name, self.base, self.pid, self.proc = name, base, pid, proc

    def stop(self) -> None:
        try:
            os.kill(self.pid, 15)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_ours() -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "render_service.cli", "serve", str(QWEN), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning",
           "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return Server("splitserve", base, proc.pid, proc)


def start_vllm(venv: Path, log: Path) -> Server:
    port = free_port()
    out = subprocess.run(["bash", str(PEER / "start.sh"), str(venv), str(QWEN), str(port), "parsers", str(log)],
                         check=True, capture_output=True, text=True)
    wrapper = int(out.stdout.strip().split()[-1])
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, None, timeout_s=600)
    pid = pid_of_port(port) or wrapper
    return Server("vllm-0.32", base, pid, None)


# ------------------------------------------------------------------------------------- workload


def build_output(tok, n: int) -> list[int]:
    """N token ids: <think> reasoning </think> content <tool_call>{...}</tool_call> <|im_end|>."""
    call = {"name": "get_weather", "arguments": {"city": "Seoul", "unit": "celsius", "note": "umbrella 🌧"}}
    head = tok.encode("<think>\n")
    mid = tok.encode("\n</think>\n\n")
    tail = tok.encode("\n<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>")
    budget = n - len(head) - len(mid) - len(tail) - 1
    reasoning = tok.encode(REASONING * (budget // 20 + 2))[: budget // 2]
    content = tok.encode(CONTENT * (budget // 20 + 2))[: budget - len(reasoning)]
    ids = head + reasoning + mid + content + tail + [tok.token_to_id("<|im_end|>")]
    assert len(ids) == n, (len(ids), n)
    return ids


def run_stream(client: httpx.Client, server: Server, ids: list[int], prompt_ids: list[int], chat: dict,
               request_id: str) -> dict:
    state = None
    reasoning, content, args, names = [], [], [], []
    finish = None
    sent = 0
    sizes = []
    cpu0, wall0 = tree_cpu_s(server.pid), time.perf_counter()
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        body = {"stream": True, "model": MODEL, "stream_state": state, "prompt_tokens": len(prompt_ids),
                "prompt_token_ids": prompt_ids, "chat_request": chat,
                "generate_chunk": {"request_id": request_id, "choices": [
                    {"index": 0, "token_ids": [t], "finish_reason": "stop" if last else None}]}}
        payload = json.dumps(body).encode()
        sent += len(payload)
        sizes.append(len(payload))
        r = client.post("/v1/chat/completions/derender", content=payload, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise SystemExit(f"{server.name} step {k}: HTTP {r.status_code} {r.text[:300]}")
        out = r.json()
        state = out["stream_state"]
        for ch in out["chunk"]["choices"]:
            d = ch.get("delta") or {}
            reasoning.append(d.get("reasoning") or d.get("reasoning_content") or "")
            content.append(d.get("content") or "")
            for tc in d.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if fn.get("name"):
                    names.append(fn["name"])
                args.append(fn.get("arguments") or "")
            finish = ch.get("finish_reason") or finish
    cpu1, wall1 = tree_cpu_s(server.pid), time.perf_counter()
    batch = client.post("/v1/chat/completions/derender", json={
        "model": MODEL, "chat_request": chat, "prompt_tokens": len(prompt_ids), "prompt_token_ids": prompt_ids,
        "generate_response": {"request_id": request_id, "choices": [
            {"index": 0, "finish_reason": "stop", "token_ids": ids}]}}).json()["choices"][0]["message"]
    streamed_args = "".join(args)
    batch_calls = batch.get("tool_calls") or []
    return {
        "tokens": len(ids),
        "server_cpu_s": round(cpu1 - cpu0, 4),
        "server_cpu_ms_per_chunk": round(1e3 * (cpu1 - cpu0) / len(ids), 4),
        "wall_s": round(wall1 - wall0, 3),
        "bytes_uploaded": sent,
        "first_request_bytes": sizes[0],
        "last_request_bytes": sizes[-1],
        "last_state_bytes": len(json.dumps(state)),
        "finish_reason": finish,
        "matches_batch": {
            "reasoning": "".join(reasoning) == (batch.get("reasoning") or batch.get("reasoning_content") or ""),
            "content": "".join(content) == (batch.get("content") or ""),
            "tool_call": bool(batch_calls) and names == [c["function"]["name"] for c in batch_calls]
            and json.loads(streamed_args) == json.loads(batch_calls[0]["function"]["arguments"]),
        },
    }


# ------------------------------------------------------------------------------------- in-process


def build_args_output(tok, n: int) -> list[int]:
    """N token ids, nearly all inside one hermes call's string argument (the tool parser's worst case)."""
    head = tok.encode('<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seoul", '
                      '"note": "')
    tail = tok.encode('"}}\n</tool_call>')
    body = tok.encode((CONTENT + 'quote \\" and {braces} ') * (n // 20 + 2))[: n - len(head) - len(tail) - 1]
    return head + body + tail + [tok.token_to_id("<|im_end|>")]


def pipeline_us_per_token(pipeline, ids: list[int], prompt_ids: list[int], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        state = pipeline.initial_state(prompt_ids)
        t0 = time.process_time()
        for t in ids:
            pipeline.feed(state, [t])
        pipeline.finish(state)
        best = min(best, time.process_time() - t0)
    return round(1e6 * best / len(ids), 2)


def in_process_standalone(n: int) -> dict:
    """in_process() without a server: the prompt is rendered in-process. Also the arguments-heavy stream."""
    import msgspec

    from render_service.bundle.model_bundle import load_bundle
    from render_service.derender.batch import pipeline_config
    from render_service.parsers.pipeline import Pipeline
    from render_service.render.render import render_chat_prompt
    from render_service.render.render_config import load_render_config
    from render_service.wire.protocol import ChatCompletionRequest

    tok = load_bundle(QWEN).tokenizer
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Seoul? Use the tool."}],
            "tools": TOOLS}
    config = load_render_config(str(QWEN), served_model_names=[MODEL], reasoning_parser="qwen3",
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    req = msgspec.convert(chat, ChatCompletionRequest)
    prompt_ids = render_chat_prompt(req, config)[0]
    out = in_process(tok, build_output(tok, n), prompt_ids, chat)
    pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id="args", choice_index=0))
    out["args_heavy_pipeline_us_per_token"] = pipeline_us_per_token(pipeline, build_args_output(tok, n), prompt_ids)
    import render_service

    out["render_service"] = str(Path(render_service.__file__).parent)
    return out


_CHILD = """
import json, sys, importlib.util
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("derender_bench_child", sys.argv[2])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
print(json.dumps(bench.in_process_standalone(int(sys.argv[3]))))
"""


def compare_trees(baseline: Path, n: int, rounds: int) -> dict:
    """This tree and ``baseline`` alternately, each round a fresh process per tree; the best of each wins."""
    runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
    for _ in range(rounds):
        for name, tree in (("baseline", baseline), ("ours", ROOT)):
            done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), __file__, str(n)], check=True,
                                  capture_output=True, text=True, cwd=str(tree))
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    keys = ("pipeline_us_per_token", "handler_us_per_chunk_incl_json", "args_heavy_pipeline_us_per_token",
            "handler_logprobs_us_per_chunk_incl_json", "gateway_us_per_event", "gateway_logprobs_us_per_event")
    best = {name: {k: min(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    return {"tokens": n, "rounds": rounds, "baseline_tree": str(baseline), "best": best,
            "ratio_ours_over_baseline": {k: round(best["ours"][k] / best["baseline"][k], 3) for k in keys},
            "runs": runs}


def in_process(tok, ids: list[int], prompt_ids: list[int], chat: dict) -> dict:
    import msgspec

    from render_service.derender.batch import pipeline_config
    from render_service.parsers.pipeline import Pipeline
    from render_service.render.render_config import load_render_config
    from render_service.wire.protocol import ChatCompletionRequest

    config = load_render_config(str(QWEN), served_model_names=[MODEL], reasoning_parser="qwen3",
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    pcfg = pipeline_config(config, msgspec.convert(chat, ChatCompletionRequest), request_id="inproc", choice_index=0)
    pipeline = Pipeline(config.tokenizer, pcfg)
    pipeline_cost = pipeline_us_per_token(pipeline, ids, prompt_ids)
    handler_us, answer_bytes = handler_us_per_chunk(config, ids, prompt_ids, chat)
    return {"tokens": len(ids), "pipeline_us_per_token": pipeline_cost,
            "handler_us_per_chunk_incl_json": handler_us, "answer_bytes_last": answer_bytes,
            "handler_logprobs_us_per_chunk_incl_json": handler_us_per_chunk(config, ids, prompt_ids, chat, True)[0],
            **gateway_us_per_event(config, ids, chat)}


def engine_logprobs(ids: list[int], top: int = LOGPROBS_TOP) -> dict:
    """An engine chunk's ``logprobs`` in vLLM 0.32+'s shape: each sampled id with ``top`` alternatives."""
    return {"content": [{"token_id": t, "logprob": -0.25, "rank": 1, "top_logprobs": [
        {"token_id": t + k, "logprob": -0.25 - k, "rank": k + 1} for k in range(top)]} for t in ids]}


def handler_us_per_chunk(config, ids: list[int], prompt_ids: list[int], chat: dict,
                         logprobs: bool = False) -> tuple[float, int]:
    """The streaming derender handler without HTTP (decode request, restore state, feed, encode answer): CPU per
    chunk and the last answer's size. ``logprobs``: every chunk carries its token's logprobs and the request asks
    for them (decoding the engine's entries, resolving token text)."""
    import msgspec

    from render_service.derender.stream import StreamRuntime, derender_chat_stream
    from render_service.wire.protocol import DerenderChatStreamRequest

    if logprobs:
        chat = {**chat, "logprobs": True, "top_logprobs": LOGPROBS_TOP}
    runtime, decoder, encoder = StreamRuntime(), msgspec.json.Decoder(DerenderChatStreamRequest), msgspec.json.Encoder()
    state, encoded = None, b""
    t0 = time.process_time()
    for t in ids:
        choice: dict = {"index": 0, "token_ids": [t], "finish_reason": None}
        if logprobs:
            choice["logprobs"] = engine_logprobs([t])
        body = encoder.encode({"stream": True, "model": MODEL, "stream_state": state, "prompt_tokens": len(prompt_ids),
                               "prompt_token_ids": prompt_ids, "chat_request": chat,
                               "generate_chunk": {"request_id": "inproc", "choices": [choice]}})
        out = derender_chat_stream(decoder.decode(body), config, runtime)
        encoded = encoder.encode(out)
        state = out.stream_state
    return round(1e6 * (time.process_time() - t0) / len(ids), 2), len(encoded)


def gateway_us_per_event(config, ids: list[int], chat: dict) -> dict:
    """The gateway's per-token work without HTTP: an engine SSE event's JSON decoded as the engine client does,
    then the chat responder's SSE bytes for it; without logprobs (the hot path) and with them."""
    import msgspec

    from render_service.gateway.responses import ChatResponder
    from render_service.render.render import render_chat
    from render_service.wire.protocol import ChatCompletionRequest, GenerateStreamResponse

    decode = msgspec.json.Decoder(GenerateStreamResponse).decode
    out = {}
    for name, extra in (("gateway_us_per_event", {}),
                        ("gateway_logprobs_us_per_event", {"logprobs": True, "top_logprobs": LOGPROBS_TOP})):
        req = msgspec.convert({**chat, "stream": True, **extra}, ChatCompletionRequest)
        responder = ChatResponder(render_chat(req, config, request_id="chatcmpl-bench"), req, config)
        events = [msgspec.json.encode({"request_id": "chatcmpl-bench", "choices": [{
            "index": 0, "token_ids": [t], "finish_reason": "stop" if i == len(ids) - 1 else None,
            **({"logprobs": engine_logprobs([t])} if extra else {})}]}) for i, t in enumerate(ids)]
        t0 = time.process_time()
        for event in events:
            responder.stream_events(0, decode(event).choices[0])
        out[name] = round(1e6 * (time.process_time() - t0) / len(ids), 2)
    return out


# ------------------------------------------------------------------------------------- main


def http_floor(client: httpx.Client, server: Server, prompt_ids: list[int], chat: dict, n: int = 500) -> dict:
    """Server CPU per request of the cheapest requests, to separate HTTP cost from derender work."""
    cpu0 = tree_cpu_s(server.pid)
    for _ in range(n):
        client.get("/health")
    cpu1 = tree_cpu_s(server.pid)
    body = json.dumps({"stream": True, "model": MODEL, "stream_state": None, "prompt_tokens": len(prompt_ids),
                       "prompt_token_ids": prompt_ids, "chat_request": chat, "generate_chunk": {
                           "request_id": "floor", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                           "total_tokens": 2}}}).encode()
    for _ in range(n):
        client.post("/v1/chat/completions/derender", content=body, headers={"content-type": "application/json"})
    cpu2 = tree_cpu_s(server.pid)
    return {"health_ms_per_request": round(1e3 * (cpu1 - cpu0) / n, 3),
            "usage_only_derender_ms_per_request": round(1e3 * (cpu2 - cpu1) / n, 3),
            "note": "usage-only chunk: same request body, no parsing work (HTTP + body decode + response)"}


def summarise(points: list[dict]) -> dict:
    ns = [p["tokens"] for p in points]
    out = {"points": points}
    if len(points) >= 2:
        out["server_cpu_exponent"] = round(fit_exponent(ns, [p["server_cpu_s"] for p in points]), 3)
        out["bytes_exponent"] = round(fit_exponent(ns, [p["bytes_uploaded"] for p in points]), 3)
    return out


def sweep(client: httpx.Client, server: Server, outputs: dict[int, list[int]], ns: list[int],
          prompt_ids: list[int], chat: dict, name: str, tag: str) -> dict:
    """A warm-up stream, then one stream per output length in ``ns``, each point printed as it lands."""
    run_stream(client, server, outputs[ns[0]][:50], prompt_ids, chat, "warmup")
    points = []
    for n in ns:
        p = run_stream(client, server, outputs[n], prompt_ids, chat, f"{tag}-{n}")
        print(name, json.dumps(p), flush=True)
        points.append(p)
    return summarise(points)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="500,1000,2000,4000")
    ap.add_argument("--vllm-tokens", default="500,1000,2000", help='comma list; "" skips vLLM')
    ap.add_argument("--vllm-venv", default=str(ROOT / "bench/.peers/vllm"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/derender_bench.json"))
    ap.add_argument("--baseline-tree", default=None,
                    help="only compare in-process costs with this other checkout (e.g. main), alternately")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vllm-from", default=None,
                    help="reuse the vLLM section of an earlier results file from this machine instead of re-running it")
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.tokens.split(",") if x]
    vllm_ns = [int(x) for x in a.vllm_tokens.split(",") if x]
    if a.baseline_tree:
        result = {"command": " ".join([sys.executable, "-m", "bench.derender_bench", *(argv or sys.argv[1:])]),
                  "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                              "loadavg_at_start": os.getloadavg(),
                              "note": "shared 2-core development machine; other sessions ran at the same time"},
                  "parsers": "qwen3 + hermes", "chunking": "1 token per feed",
                  "in_process_vs_baseline": compare_trees(Path(a.baseline_tree).resolve(), max(ns), a.rounds)}
        result["machine"]["loadavg_at_end"] = os.getloadavg()
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_result(Path(a.out), result)
        print(json.dumps(result["in_process_vs_baseline"]["ratio_ours_over_baseline"], indent=2))
        return 0

    from render_service.bundle.model_bundle import load_bundle

    tok = load_bundle(QWEN).tokenizer
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Seoul? Use the tool."}],
            "tools": TOOLS}
    outputs = {n: build_output(tok, n) for n in sorted(set(ns) | set(vllm_ns))}
    result: dict = {"command": " ".join([sys.executable, "-m", "bench.derender_bench", *(argv or sys.argv[1:])]),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "loadavg_at_start": os.getloadavg()},
                    "chunking": "1 token per call", "parsers": "qwen3 + hermes"}
    servers: list[Server] = []
    try:
        ours = start_ours()
        servers.append(ours)
        with httpx.Client(base_url=ours.base, timeout=120.0) as client:
            prompt_ids = client.post("/v1/chat/completions/render", json=chat).json()["token_ids"]
            result["prompt_tokens"] = len(prompt_ids)
            result["splitserve"] = sweep(client, ours, outputs, ns, prompt_ids, chat, "splitserve", "ours")
            result["splitserve"]["http_floor"] = http_floor(client, ours, prompt_ids, chat)
        ours.stop()
        servers.remove(ours)
        if a.vllm_from:
            earlier = json.loads(Path(a.vllm_from).read_text())
            result["vllm"] = earlier["vllm"]
            result["vllm"]["reused_from"] = {"file": a.vllm_from, "command": earlier.get("command"),
                                             "loadavg_at_start": earlier.get("machine", {}).get("loadavg_at_start")}
        elif vllm_ns:
            log = ROOT / "bench/.peers/vllm-render.log"  # ignored by git
            log.parent.mkdir(parents=True, exist_ok=True)
            vllm = start_vllm(Path(a.vllm_venv), log)
            servers.append(vllm)
            with httpx.Client(base_url=vllm.base, timeout=600.0) as client:
                result["vllm"] = sweep(client, vllm, outputs, vllm_ns, prompt_ids, chat, "vllm", "vllm")
    finally:
        for s in servers:
            s.stop()
    result["in_process"] = in_process(tok, outputs[max(ns)], prompt_ids, chat)
    # comparison at each N; vLLM points not measured are extrapolated with vLLM's measured exponent
    if "vllm" in result:
        vp = {p["tokens"]: p for p in result["vllm"]["points"]}
        exp = result["vllm"].get("server_cpu_exponent")
        ref_n = max(vp)
        rows = []
        for p in result["splitserve"]["points"]:
            n = p["tokens"]
            if n in vp:
                v_cpu, v_bytes, extrapolated = vp[n]["server_cpu_s"], vp[n]["bytes_uploaded"], False
            elif exp is not None:
                v_cpu = vp[ref_n]["server_cpu_s"] * (n / ref_n) ** exp
                v_bytes = vp[ref_n]["bytes_uploaded"] * (n / ref_n) ** result["vllm"]["bytes_exponent"]
                extrapolated = True
            else:
                continue
            rows.append({"tokens": n, "splitserve_cpu_s": p["server_cpu_s"], "vllm_cpu_s": round(v_cpu, 3),
                         "cpu_ratio_vllm_over_ours": round(v_cpu / max(p["server_cpu_s"], 1e-9), 1),
                         "splitserve_bytes": p["bytes_uploaded"], "vllm_bytes": int(v_bytes),
                         "vllm_extrapolated": extrapolated})
        result["comparison"] = rows
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(a.out), result)
    print(json.dumps({k: v for k, v in result.items() if k in ("comparison", "in_process")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
