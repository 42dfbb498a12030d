"""What a /render job costs besides the chat template and tokenizing, this checkout against another, in one run.

The request is the last turn of a growing agent trace (bench/agent_trace.py, the same one
``agent_render_bench --profile-only`` profiles). Each checkout runs in a worker process of its own (its tree first
on sys.path, this interpreter and its packages), which builds the render configuration, renders the turn before
and then the turn itself once (so the piece cache and the prefix store hold it: every piece a hit), and then
answers timing requests. The workers take turns, stage by stage and round by round, the first of each round
alternating, so both see the same machine load; a figure is the best thread-CPU time (ms) over every repeat of
every round.

Stages (all with every tokenizing piece a cache hit):
  json_decode_request     msgspec decode of the body into ChatCompletionRequest
  prepare_messages_and_tools  chat_messages.prepare_messages + convert_developer_role + prepare_tools
  chat_template           ChatTemplate.render of the prepared messages and tools
  tokenize_hit            the prompt encoder on the rendered text (the same str object every time)
  tokenize_hit_fresh_text the same on a fresh copy of that text, as a real request brings (copy made untimed)
  render_chat             render.render_chat on the decoded request
  whole_job               decode + render_chat + the response's JSON (server._encode_generate_request)
and, per checkout, ``other = render_chat - chat_template - tokenize_hit`` and ``other_fresh`` (with the fresh-text
tokenizing): what render_chat spends besides the two.

usage: python -m bench.experiments.render_overhead_ab --base CHECKOUT [--sizes 32768] [--rounds 15] [--repeats 20]
Results: bench/results/render_overhead_ab.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import peers
from bench.portable import write_result

RESULTS = peers.REPO / "bench" / "results"
STAGES = ("json_decode_request", "prepare_messages_and_tools", "chat_template", "tokenize_hit",
          "tokenize_hit_fresh_text", "render_chat", "whole_job")

# Runs in each checkout's worker: only APIs both checkouts have (render_chat, ChatTemplate.render, ...).
WORKER = r'''
import json, sys, time
sys.path.insert(0, TREE)
import msgspec
import render_service
from bench.agent_render_bench import FIXTURE, MODEL, trace_to
from bench.agent_trace import AgentTraceSpec, chat_body
from render_service.templates.chat_messages import convert_developer_role, prepare_messages, prepare_tools
from render_service.wire.protocol import ChatCompletionRequest
from render_service.render.render import render_chat
from render_service.render.render_config import load_render_config
from render_service.http.server import _encode_generate_request

assert render_service.__file__.startswith(TREE), render_service.__file__
config = load_render_config(str(FIXTURE), served_model_names=[MODEL], max_model_len=4 * SIZE,
                            reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
messages, tools, ends = trace_to(SIZE, 99, AgentTraceSpec(result_chars=(SIZE // 30, SIZE // 10)),
                                 lambda m, t: len(render_chat(ChatCompletionRequest(messages=m, tools=t), config)
                                                  .token_ids))
decoder = msgspec.json.Decoder(ChatCompletionRequest)
before = max(e for e in ends if e < len(messages))
render_chat(decoder.decode(msgspec.json.encode(chat_body(MODEL, messages[:before], tools))), config)
body = msgspec.json.encode(chat_body(MODEL, messages, tools))
req = decoder.decode(body)
gen = render_chat(req, config)
template = config.template
prepared = convert_developer_role(prepare_messages(req.messages, template.content_format), template)
prepared_tools = prepare_tools(req.tools)
text = template.render(prepared, tools=prepared_tools, add_generation_prompt=True)
encoder = config.prompt_encoder
assert list(encoder.encode(text)) == list(gen.token_ids)

def fresh_text():
    return (text + " ")[:-1]

STAGES = {
    "json_decode_request": (None, lambda _: decoder.decode(body)),
    "prepare_messages_and_tools": (None, lambda _: (convert_developer_role(
        prepare_messages(req.messages, template.content_format), template), prepare_tools(req.tools))),
    "chat_template": (None, lambda _: template.render(prepared, tools=prepared_tools, add_generation_prompt=True)),
    "tokenize_hit": (None, lambda _: encoder.encode(text)),
    "tokenize_hit_fresh_text": (fresh_text, encoder.encode),
    "render_chat": (None, lambda _: render_chat(req, config)),
    "whole_job": (None, lambda _: _encode_generate_request(render_chat(decoder.decode(body), config))),
}
print(json.dumps({"ready": True, "prompt_tokens": len(gen.token_ids), "messages": len(messages),
                  "body_bytes": len(body), "chars": len(text), "ascii": text.isascii(),
                  "response_sha": __import__("hashlib").sha256(_encode_generate_request(gen).replace(
                      gen.request_id.encode(), b"")).hexdigest()[:16]}), flush=True)
for line in sys.stdin:
    stage, repeats = line.split()
    setup, fn = STAGES[stage]
    spent = []
    for _ in range(int(repeats)):
        arg = setup() if setup is not None else None
        started = time.thread_time()
        fn(arg)
        spent.append(time.thread_time() - started)
    print(json.dumps(min(spent) * 1e3), flush=True)
'''


class Worker:
    def __init__(self, tree: Path, size: int) -> None:
        source = WORKER.replace("TREE", repr(str(tree))).replace("SIZE", str(size))
        self.proc = subprocess.Popen([sys.executable, "-c", source], cwd=tree, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker exited with {self.proc.wait()}")
        return line

    def best_ms(self, stage: str, repeats: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{stage} {repeats}\n")
        self.proc.stdin.flush()
        return float(json.loads(self._line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def compare(trees: dict[str, Path], size: int, rounds: int, repeats: int) -> dict[str, Any]:
    workers = {name: Worker(tree, size) for name, tree in trees.items()}
    try:
        infos = {name: w.info for name, w in workers.items()}
        shas = {info.pop("response_sha") for info in infos.values()}
        if len(shas) != 1:
            raise SystemExit(f"the checkouts answer this request differently ({infos}); refusing to time")
        rows: dict[str, dict[str, list[float]]] = {name: {s: [] for s in STAGES} for name in workers}
        names = list(workers)
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for stage in STAGES:
                for name in order:
                    rows[name][stage].append(workers[name].best_ms(stage, repeats))
    finally:
        for w in workers.values():
            w.close()
    out: dict[str, Any] = {"request": next(iter(infos.values())), "ms": {}}
    for name in names:
        best = {s: round(min(v), 4) for s, v in rows[name].items()}
        best["other"] = round(best["render_chat"] - best["chat_template"] - best["tokenize_hit"], 4)
        best["other_fresh"] = round(best["render_chat"] - best["chat_template"] - best["tokenize_hit_fresh_text"], 4)
        out["ms"][name] = best
    new, old = out["ms"][names[0]], out["ms"][names[1]]
    out[f"{names[1]}_over_{names[0]}"] = {s: round(old[s] / new[s], 2) for s in new if new[s] > 0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the checkout to compare against (a git worktree of main, say)")
    ap.add_argument("--base-label", default="main")
    ap.add_argument("--sizes", default="32768")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "render_overhead_ab.json"))
    args = ap.parse_args(argv)
    from bench.agent_render_bench import git_commit

    base = Path(args.base).resolve()
    trees = {"this": peers.REPO, args.base_label: base}
    load_start = [round(x, 2) for x in os.getloadavg()]
    report: dict[str, Any] = {"sizes": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        report["sizes"][str(size)] = compare(trees, size, args.rounds, args.repeats)
        print(f"# {size}: {json.dumps(report['sizes'][str(size)])}", flush=True)
    report.update({
        "command": " ".join([sys.executable, "-m", "bench.experiments.render_overhead_ab", *(argv or sys.argv[1:])]),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "commits": {"this": git_commit(peers.REPO), args.base_label: git_commit(base)},
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "rounds": args.rounds, "repeats": args.repeats,
        "note": "one shared machine (other sessions ran at the same time); best thread-CPU ms over all rounds, the "
                "two checkouts alternating stage by stage",
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(args.out), report)
    print(f"# wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
