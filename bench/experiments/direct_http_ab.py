"""The render endpoints answered from the HTTP protocol (direct_http.py) against the ASGI path, in one run.

Two render servers of this checkout, one with ``SPLITSERVE_DIRECT_HTTP=0`` (every request through uvicorn's
ASGI cycle, the ops middleware and Starlette's response), each sent the same bodies in turn from one keep-alive
client; server CPU per request from the process's schedstat (bench/agent_render_bench.TreeCpu). Bodies: the last
turn of a 32k-token agent trace (every piece cached after the first send), and a one-message chat.

usage: python -m bench.experiments.direct_http_ab [--size 32768] [--rounds 8] [--per-round 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.agent_render_bench import (
    MODEL,
    RENDER_PATH,
    RESULTS,
    LastTurn,
    TreeCpu,
    git_commit,
    long_context_model,
    start_ours,
)
from bench.peers import REPO, wait_healthy
from bench.portable import write_result

SERVERS = {"direct": {}, "asgi": {"SPLITSERVE_DIRECT_HTTP": "0"}}


def server_cpu_ms(client: httpx.Client, cpu: TreeCpu, body: bytes) -> float:
    before = cpu.ns()
    r = client.post(RENDER_PATH, content=body, headers={"content-type": "application/json"})
    after = cpu.ns()
    r.raise_for_status()
    return (after - before) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--out", default=str(RESULTS / "direct_http_ab.json"))
    args = ap.parse_args(argv)

    turn = LastTurn(args.size)
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}).encode()
    bodies = {f"agent_turn_{args.size}": turn.body, "one_message": small}
    model = long_context_model(4 * args.size)
    logs = Path(tempfile.mkdtemp(prefix="direct-http-ab-"))
    pids, clients, cpus = {}, {}, {}
    try:
        for port, (name, env) in enumerate(SERVERS.items(), start=18310):
            pids[name] = start_ours(model, port, logs / f"{name}.log", None, 4 * args.size, env=env)
            clients[name] = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        for name, client in clients.items():
            wait_healthy(str(client.base_url), pids[name])
            cpus[name] = TreeCpu(pids[name])
            for body in bodies.values():
                for _ in range(10):  # warm: the pieces cached, the code paths run
                    server_cpu_ms(client, cpus[name], body)
        load = [round(x, 2) for x in os.getloadavg()]
        rows: dict[str, dict[str, list[float]]] = {b: {s: [] for s in SERVERS} for b in bodies}
        for _ in range(args.rounds):  # the servers in turn, a block each, so both see the same load over time
            for body_name, body in bodies.items():
                for name in SERVERS:
                    rows[body_name][name] += [server_cpu_ms(clients[name], cpus[name], body)
                                              for _ in range(args.per_round)]
    finally:
        for pid in pids.values():
            os.kill(pid, 15)
    result: dict[str, Any] = {"bench": "direct_http_ab", "commit": git_commit(REPO), "when": time.strftime("%F %T"),
                              "machine": {"cpus": os.cpu_count(), "note": "shared 2-core VM; load average at start"},
                              "load": load,
                              "command": "python -m bench.experiments.direct_http_ab " + " ".join(sys.argv[1:]),
                              "bodies": {}}
    for body_name, per_server in rows.items():
        means = {name: round(statistics.mean(v), 4) for name, v in per_server.items()}
        medians = {name: round(statistics.median(v), 4) for name, v in per_server.items()}
        result["bodies"][body_name] = {
            "requests_per_server": len(per_server["direct"]), "server_cpu_ms_mean": means,
            "server_cpu_ms_median": medians,
            "asgi_minus_direct_ms_mean": round(means["asgi"] - means["direct"], 4),
            "asgi_over_direct_mean": round(means["asgi"] / means["direct"], 3)}
    print(json.dumps(result, indent=1))
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
