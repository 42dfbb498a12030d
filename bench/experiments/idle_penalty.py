"""What a render job costs right after its process slept, against back to back (thread CPU, in process).

The agent bench's rotating order has each server idle while the others work; on some machines (the shared VM
this project is developed on) the next job then costs several times its back-to-back CPU, with no page faults.
This measures that effect alone: the same 32k-token agent turn (all pieces cached, so only the job's own work
remains), median thread CPU after each pause, and one stage at a time after the longest pause.

usage: python -m bench.experiments.idle_penalty [--size 32768] [--pauses-ms 0,10,30,100,300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.agent_render_bench import RESULTS, LastTurn
from bench.portable import portable


def median_ms(job: Callable[[], Any], pause_s: float, repeats: int) -> tuple[float, int]:
    """(median thread CPU ms of ``job`` after sleeping ``pause_s``, minor + major page faults over all runs)."""
    spent = []
    before = resource.getrusage(resource.RUSAGE_THREAD)
    for _ in range(repeats):
        if pause_s:
            time.sleep(pause_s)
        started = time.thread_time()
        job()
        spent.append(time.thread_time() - started)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    faults = after.ru_minflt - before.ru_minflt + after.ru_majflt - before.ru_majflt
    return round(1e3 * statistics.median(spent), 3), faults


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--pauses-ms", default="0,10,30,100,300")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "idle_penalty.json"))
    args = ap.parse_args(argv)

    from render_service.http.server import _encode_generate_request
    from render_service.render.render import render_chat

    turn = LastTurn(args.size)
    config, body, decoder, req, template = turn.config, turn.body, turn.decoder, turn.req, turn.template
    generated = render_chat(req, config)

    def whole_job() -> None:
        _encode_generate_request(render_chat(decoder.decode(body), config))

    pauses = [float(p) / 1e3 for p in args.pauses_ms.split(",")]
    rows = {}
    for pause in pauses:
        ms, faults = median_ms(whole_job, pause, args.repeats)
        rows[f"{pause * 1e3:g}"] = {"job_ms": ms, "page_faults": faults}
        print(f"after {pause * 1e3:5g} ms asleep: job {ms:.3f} ms (page faults {faults})", flush=True)
    stages: dict[str, Callable[[], Any]] = {
        "json_decode": lambda: decoder.decode(body),
        "prepare_messages_and_tools": turn.prepare,
        "chat_template": lambda: template.render(turn.prepared, tools=turn.prepared_tools, add_generation_prompt=True),
        "response_json": lambda: _encode_generate_request(generated),
    }
    longest = max(pauses)
    stage_rows = {}
    for name, stage in stages.items():
        warm, _ = median_ms(stage, 0.0, args.repeats)
        cold, _ = median_ms(stage, longest, args.repeats)
        stage_rows[name] = {"back_to_back_ms": warm, f"after_{longest * 1e3:g}_ms_asleep": cold,
                            "ratio": round(cold / warm, 2) if warm else None}
        print(f"{name}: {warm:.3f} ms back to back, {cold:.3f} ms after {longest * 1e3:g} ms asleep", flush=True)
    out = {"size": args.size, "prompt_tokens": len(generated.token_ids), "repeats": args.repeats,
           "whole_job_after_pause": rows, "stages": stage_rows,
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(args.out, "w") as f:
        f.write(json.dumps(portable(out), indent=2))
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
