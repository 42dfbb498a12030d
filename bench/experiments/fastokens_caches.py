"""fastokens' own caches and threads against our piece cache: the CPU of turning a rendered prompt into its ids'
JSON, on the agent bench's workloads.

vllm-rs and our render tier run the same fastokens; fastokens can also cache by itself: a segment cache (the text
between added tokens, the idea of our piece cache, ``enable_segment_cache`` / ``FASTOKENS_SEGMENT_CACHE``), an
input cache (``FASTOKENS_INPUT_CACHE``, read when an instance is built), and worker threads for one long encode
(``FASTOKENS_BPE_THREADS``; the render tier sets 1). Each variant runs in a process of its own (the variables are
read as fastokens starts) over the same prompts, rendered by the Qwen3 fixture's template from the agent bench's
traces (bench/agent_render_bench.py):

- growing: --agents conversations turn by turn, round-robin; timed: the turns whose prompt is in (size/2, size];
- unrelated: --unrelated conversations of about ``size`` tokens, each once.

The prompts are rendered once, in the parent; no variant's process has encoded any of their text before it is
timed. Per prompt: the CPU of every thread of the process (schedstat: fastokens' workers count too) from the text to the
JSON of its ids, as a render server writes it: ours through ``IncrementalEncoder.encode_ids`` (the piece cache and
the prompt store) and the pieces' JSON joined; fastokens' ``encode`` as a list written by msgspec, or its flat
batch (``encode_batch_flat``, no int object per id) written by orjson. Every variant's ids are checked equal to
ours on every prompt.

usage: python -m bench.experiments.fastokens_caches [--sizes 32768,131072] [--agents 6,3] [--unrelated 12,6]
                                                    [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.agent_render_bench import FIXTURE, RESULTS, per_size, trace_to
from bench.agent_trace import AgentTraceSpec
from bench.peers import REPO
from bench.portable import write_result

CACHE_MIB = 256
# name -> (environment, how the prompt becomes ids and their JSON)
VARIANTS: dict[str, tuple[dict[str, str], str]] = {
    "ours": ({}, "ours"),
    "fastokens": ({}, "list"),
    "fastokens_flat": ({}, "flat"),
    "segment_cache": ({"FASTOKENS_SEGMENT_CACHE": str(CACHE_MIB)}, "list"),
    "segment_cache_flat": ({"FASTOKENS_SEGMENT_CACHE": str(CACHE_MIB)}, "flat"),
    "input_cache": ({"FASTOKENS_INPUT_CACHE": str(CACHE_MIB)}, "list"),
    "threads_2": ({"FASTOKENS_BPE_THREADS": "2"}, "list"),
    "threads_2_segment_cache_flat": ({"FASTOKENS_BPE_THREADS": "2", "FASTOKENS_SEGMENT_CACHE": str(CACHE_MIB)},
                                     "flat"),
}


def _process_cpu_ns() -> int:
    """This thread's CPU (its own clock: a running thread's schedstat lags by up to a tick) and every other
    thread's (schedstat: fastokens' workers, idle by the time this reads them)."""
    own = str(threading.get_native_id())
    total = time.thread_time_ns()
    for task in os.listdir("/proc/self/task"):
        if task == own:
            continue
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return total


def prompts(size: int, agents: int, unrelated: int) -> tuple[list[tuple[str, bool]], list[str]]:
    """(growing prompts in send order with whether each is timed, unrelated prompts), rendered by the fixture's
    template as the agent bench's servers render them."""
    from render_service.bundle.model_bundle import load_bundle
    from render_service.templates.chat_messages import prepare_messages, prepare_tools
    from render_service.templates.chat_template import ChatTemplate

    bundle = load_bundle(FIXTURE)
    template = ChatTemplate(bundle.chat_template, bundle.template_special_tokens, loop_record_bytes=0)

    def text_of(messages: list[dict], tools: list[dict]) -> str:
        return template.render(prepare_messages(messages), tools=prepare_tools(tools), add_generation_prompt=True)

    def count(messages: list[dict], tools: list[dict]) -> int:
        return len(bundle.tokenizer.encode(text_of(messages, tools)))

    spec = AgentTraceSpec(result_chars=(size // 30, size // 10))
    per_agent = []
    for i in range(agents):
        messages, tools, ends = trace_to(size, 1000 * size + i, spec, count)
        turns = []
        for end in ends:
            text = text_of(messages[:end], tools)
            tokens = len(bundle.tokenizer.encode(text))
            if tokens <= size:
                turns.append((text, tokens > size / 2))
        per_agent.append(turns)
    growing = [turns[t] for t in range(max(map(len, per_agent))) for turns in per_agent if t < len(turns)]
    fresh = []
    for i in range(unrelated):
        messages, tools, ends = trace_to(size, 7_000_000 + 1000 * size + i, spec, count)
        end = max(e for e in ends if count(messages[:e], tools) <= size * 1.05) if ends else len(messages)
        fresh.append(text_of(messages[:end], tools))
    return growing, fresh


def run_variant(how: str, growing: list[tuple[str, bool]], fresh: list[str]) -> dict[str, Any]:
    """This process's variant over the prompts (none of whose text it has seen): CPU ms per timed growing turn and
    per unrelated prompt (mean, median and the most: fastokens' word cache now and then takes tens of ms to grow,
    whichever variant it falls in), and whether every prompt's ids equal our tokenizer's (checked after the timing, so
    that no check warms a cache the variant reads)."""
    import array

    import msgspec
    import numpy as np
    import orjson

    from render_service.tokenize.incremental_tokenizer import IncrementalEncoder
    from render_service.tokenize.tokenizer import TextTokenizer

    encode_json = msgspec.json.Encoder().encode
    if how == "ours":
        encoder = IncrementalEncoder(TextTokenizer.from_file(FIXTURE / "tokenizer.json"))

        def ids_and_json(text: str) -> tuple[Any, bytes]:
            view = encoder.encode_ids(text)
            return view, b"[" + b",".join(view.json_parts) + b"]"  # type: ignore[attr-defined]
    else:
        import fastokens

        native = fastokens.Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
        native.no_truncation()
        native.no_padding()
        if how == "list":
            def ids_and_json(text: str) -> tuple[Any, bytes]:
                ids = native.encode(text).ids
                return ids, encode_json(ids)
        else:
            option = orjson.OPT_SERIALIZE_NUMPY

            def ids_and_json(text: str) -> tuple[Any, bytes]:
                raw, _ = native.encode_batch_flat([text])
                ids = array.array("I")
                ids.frombytes(raw)
                return ids, orjson.dumps(np.frombuffer(ids, dtype=np.uint32), option=option)

    ids_and_json("warm up the first call")
    answers: list[list[int]] = []

    def timed(text: str) -> float:
        started = _process_cpu_ns()
        ids, _ = ids_and_json(text)
        spent = (_process_cpu_ns() - started) / 1e6
        answers.append(list(ids))
        return spent

    growing_ms = [ms for (text, keep) in growing for ms in [timed(text)] if keep]
    fresh_ms = [timed(text) for text in fresh]
    reference = TextTokenizer.from_file(FIXTURE / "tokenizer.json")  # (fastokens or tiktoken: proved equal)
    texts = [text for text, _ in growing] + fresh
    equal = all(ids == reference.encode(text) for ids, text in zip(answers, texts, strict=True))
    return {"growing_ms": round(statistics.mean(growing_ms), 3), "growing_ms_median": round(statistics.median(
                growing_ms), 3), "growing_ms_max": round(max(growing_ms), 3), "growing_turns": len(growing_ms),
            "unrelated_ms": round(statistics.mean(fresh_ms), 3), "unrelated_ms_median": round(statistics.median(
                fresh_ms), 3), "unrelated_ms_max": round(max(fresh_ms), 3), "unrelated_prompts": len(fresh_ms),
            "ids_equal_ours": equal}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--agents", default=None, help="growing conversations per size (default 6 at 32k, 3 else)")
    ap.add_argument("--unrelated", default=None, help="unrelated conversations per size (default 12 at 32k, 6 else)")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # (a child process: one variant)
    ap.add_argument("--out", default=str(RESULTS / "fastokens_caches.json"))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    agents = per_size(args.agents, sizes, {32768: 6}, 3)
    unrelated = per_size(args.unrelated, sizes, {32768: 12}, 6)
    if args.variant is not None:  # (the prompts come from the parent, as JSON on stdin)
        given = json.loads(sys.stdin.read())
        out = {size: run_variant(VARIANTS[args.variant][1], [(t, k) for t, k in work["growing"]], work["unrelated"])
               for size, work in given.items()}
        print(json.dumps(out))
        return 0
    work = {}
    for size, n_agents, n_unrelated in zip(sizes, agents, unrelated, strict=True):
        growing, fresh = prompts(size, n_agents, n_unrelated)
        work[str(size)] = {"growing": growing, "unrelated": fresh}
    given = json.dumps(work)
    results: dict[str, Any] = {}
    for name, (env, _) in VARIANTS.items():
        command = [sys.executable, "-m", "bench.experiments.fastokens_caches", "--variant", name]
        done = subprocess.run(command, input=given, capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "FASTOKENS_BPE_THREADS": "1", **env})
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"# {name}: {results[name]}", flush=True)
    report = {"command": " ".join([sys.executable, "-m", "bench.experiments.fastokens_caches",
                                   *(argv or sys.argv[1:])]),
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
              "cache_mib": CACHE_MIB, "variants": {name: env for name, (env, _) in VARIANTS.items()},
              "results": results}
    write_result(Path(args.out), report)
    print(f"# wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
