"""gpt-oss (Harmony) renders through the servers: server CPU per render, ours against vLLM 0.34's Rust render
server (vllm-rs), one run.

Workloads, each at --sizes prompt tokens (default 32k, 128k), on the gpt-oss test bundle (the o200k_harmony
tokenizer; a copy whose config.json names the gpt_oss model type, which vllm-rs picks its Harmony renderer by):
  growing    --agents chat conversations (a system prompt, then user turns and answers with reasoning, tools
             declared) rendered turn by turn, round-robin like concurrent clients; timed: the turns whose prompt
             is in (size/2, size].
  unrelated  --unrelated such conversations of about ``size`` tokens, each rendered once.

The conversations hold no tool calls: vllm-rs 0.34 renders an earlier turn's call as the model writes it
(``<|channel|>commentary to=functions.NAME <|constrain|>json``) where vLLM's Python server, and ours after it,
render openai-harmony's form (``to=functions.NAME<|channel|>commentary json``), and without tools vllm-rs still
announces the commentary channel; on these conversations every server returns the same ids (checked before
timing). Server CPU per render is read as bench/agent_render_bench.py reads it (schedstat of the server's
process tree around each request, each body sent to every server in turn, --order as there).

    python -m bench.harmony_server_bench [--sizes 32768,131072] [--vllm-rs BIN] [--ab-tree CHECKOUT --ab-label NAME]

Results: bench/results/harmony_server_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench import peers
from bench.agent_render_bench import (
    RENDER_PATH,
    TreeCpu,
    check_same_ids,
    git_commit,
    in_order,
    long_context_model,
    measure,
    summarize,
)
from bench.extend_bench import _chat_conversation
from bench.portable import write_result

RESULTS = peers.REPO / "bench" / "results"
MODEL = "gpt-oss"
OURS_FLAGS = ["--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice", "--tool-call-parser", "openai"]
# (vllm-rs registers no tool parser by the name "openai": its Harmony renderer parses calls itself)
VLLM_RS_FLAGS = ["--reasoning-parser", "auto", "--tool-call-parser", "auto"]
# Both servers take the conversation's date from here (a request names none), so their system messages agree.
START_DATE = {"VLLM_SYSTEM_START_DATE": "2026-12-01"}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a fact up.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
DEFAULT_AGENTS = {32768: 4, 131072: 2}
DEFAULT_UNRELATED = {32768: 13, 131072: 7}


def conversation(size: int, seed: int) -> list[dict[str, Any]]:
    """A chat whose Harmony prompt is about ``size`` tokens, ending with a user turn (bench/extend_bench.py's, its
    own system prompt a conversation's); each answer carries reasoning (which the next answer's render drops)."""
    return _chat_conversation(size, seed, f"You answer questions ({seed}).", reasoning=True)


def body(messages: list[dict[str, Any]]) -> bytes:
    return msgspec.json.encode({"model": MODEL, "messages": messages, "tools": [TOOL]})


def growing_bodies(size: int, agents: int) -> list[bytes]:
    """The timed turns of ``agents`` conversations, interleaved as concurrent clients send them; the turns before
    are sent untimed first (each client's history as the servers would have seen it)."""
    turns: list[list[bytes]] = []
    for agent in range(agents):
        messages = conversation(size, 1000 * size + agent)
        ends = [i for i in range(2, len(messages) + 1) if messages[i - 1]["role"] == "user"]
        turns.append([body(messages[:end]) for end in ends])
    longest = max(map(len, turns))
    return [turns[a][i] for i in range(longest) for a in range(agents) if i < len(turns[a])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--vllm-rs", default=None, help="vllm-rs binary (default as bench/peers.py finds it)")
    ap.add_argument("--ab-tree", default=None, help="another checkout of this repository: its render server joins "
                                                    "the rotation as ours@LABEL (an A/B in the same run)")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the A/B server (repeatable; without --ab-tree it runs this "
                         "checkout)")
    ap.add_argument("--ab-label", default="ab")
    ap.add_argument("--order", choices=["balanced", "rotate", "server"], default="balanced")
    ap.add_argument("--out", default=str(RESULTS / "harmony_server_bench.json"))
    args = ap.parse_args(argv)
    from render_service.harmony.bundle import gpt_oss_bundle_dir

    sizes = [int(s) for s in args.sizes.split(",")]
    max_len = 2 * max(sizes)
    model = long_context_model(max_len, gpt_oss_bundle_dir(), model_type="gpt_oss",
                               architectures=["GptOssForCausalLM"])
    logs = Path(tempfile.mkdtemp(prefix="harmony-bench-logs-"))
    servers: dict[str, dict[str, Any]] = {}
    from bench.agent_render_bench import start_ours

    port = peers.free_port()
    servers["ours"] = {"port": port, "commit": git_commit(peers.REPO), "pid": start_ours(
        model, port, logs / "ours.log", None, max_len, env=START_DATE, served=MODEL, parser_flags=OURS_FLAGS)}
    if args.ab_tree or args.ab_env:
        port = peers.free_port()
        tree = Path(args.ab_tree).resolve() if args.ab_tree else peers.REPO
        env = {**START_DATE, **dict(item.split("=", 1) for item in args.ab_env)}
        servers[f"ours@{args.ab_label}"] = {"port": port, "commit": git_commit(tree), "env": env, "pid": start_ours(
            model, port, logs / "ours-ab.log", None, max_len, tree, env, served=MODEL, parser_flags=OURS_FLAGS)}
    binary = Path(args.vllm_rs) if args.vllm_rs else peers.vllm_rs_binary()
    if binary is not None:
        port = peers.free_port()
        servers["vllm-rs"] = {"port": port, "binary": str(binary), "pid": peers.start_vllm_rs(
            binary, model, port, served_model_name=MODEL, max_model_len=max_len, log=logs / "vllm-rs.log",
            parser_flags=VLLM_RS_FLAGS, env=START_DATE).pid}
    else:
        print("# vllm-rs: no binary found ($SPLITSERVE_VLLM_RS or bench/.peers/vllm-rs)", flush=True)
    summary: dict[str, Any] = {}
    try:
        for info in servers.values():
            peers.wait_healthy(f"http://127.0.0.1:{info['port']}", info["pid"])
        clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{info['port']}", timeout=600)
                   for name, info in servers.items()}
        cpus = {name: TreeCpu(info["pid"]) for name, info in servers.items()}
        for size in sizes:
            summary[str(size)] = run_size(clients, cpus, size, DEFAULT_AGENTS.get(size, 2),
                                          DEFAULT_UNRELATED.get(size, 3), args.order)
            print(f"# {size} {json.dumps(summary[str(size)])}", flush=True)
    finally:
        for info in servers.values():
            peers.stop_tree(info["pid"])
        shutil.rmtree(model, ignore_errors=True)
    report = {"command": " ".join(["python -m bench.harmony_server_bench", *(argv or sys.argv[1:])]),
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
              "order": args.order, "summary": summary,
              "servers": {k: {kk: vv for kk, vv in v.items() if kk != "pid"} for k, v in servers.items()}}
    write_result(Path(args.out), report)
    print(f"# wrote {args.out}", flush=True)
    return 0


def run_size(clients: dict[str, httpx.Client], cpus: dict[str, TreeCpu], size: int, agents: int, unrelated: int,
             order: str) -> dict[str, Any]:
    growing = growing_bodies(size, agents)
    fresh = [body(conversation(size, 7 + 1000 * size + i)) for i in range(unrelated)]
    check_same_ids(clients, growing[-1])
    check_same_ids(clients, fresh[0])
    names = list(clients)
    # untimed: the turns up to half the size (each server sees every client's history)
    half = [b for b in growing if _tokens_estimate(b) <= size // 2]
    timed = [b for b in growing if _tokens_estimate(b) > size // 2]
    for name, one in in_order(names, half, order):
        clients[name].post(RENDER_PATH, content=one, headers={"content-type": "application/json"})
    out: dict[str, Any] = {}
    for label, bodies in (("growing", timed), ("unrelated", fresh[1:])):
        rows: dict[str, list[tuple[float, float, int]]] = {name: [] for name in names}
        for name, one in in_order(names, bodies, order):
            rows[name].append(measure(clients[name], cpus[name], one))
        out[label] = {name: summarize(r) for name, r in rows.items()}
    ours = out["growing"]["ours"]["cpu_ms_mean"], out["unrelated"]["ours"]["cpu_ms_mean"]
    for name in names:
        if name != "ours":
            out[f"growing_ours_over_{name}"] = round(ours[0] / out["growing"][name]["cpu_ms_mean"], 3)
            out[f"unrelated_ours_over_{name}"] = round(ours[1] / out["unrelated"][name]["cpu_ms_mean"], 3)
    out["growing_median_ms"] = {name: value["cpu_ms_median"] for name, value in out["growing"].items()}
    return out


def _tokens_estimate(one: bytes) -> int:
    """The prompt's size as ``conversation`` counts it (four characters of its text a token)."""
    messages = msgspec.json.decode(one)["messages"]
    return sum(len(m["content"]) + len(m.get("reasoning", "")) for m in messages[1:]) // 4


if __name__ == "__main__":
    sys.exit(main())
