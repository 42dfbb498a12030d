"""A masked extend's probes against the full render: the shipped comparison (extend/bridge.py: a differing chunk
halved in C down to 16 elements) against walking the differing chunk element by element, in one process.

A loss-mask probe's render shares all but its last few blocks with the full render (some 2,800 blocks at 212k
tokens), so the chunk that differs is nearly the whole list. The last turn of an agent conversation of about
each size (bench/extend_bench.py's), extended by the reference of the turn before, with both masks asked for;
each rep renders the turn before (loop records as an RL loop leaves them) and then the timed turn with one
comparison and then with the other (the first alternating), thread CPU from the body to the answer's JSON.
The two answers are checked equal.

usage: python -m bench.experiments.mask_probe_compare [--sizes 8192,32768,131072] [--reps 30] [--out FILE]
Results: bench/results/mask_probe_compare.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from bench.extend_bench import FIXTURE, RESULTS, TOOLS, _conversation, _sampled_text, body_renderer
from bench.portable import write_result
from render_service.bundle.model_bundle import load_bundle
from render_service.extend import bridge, turns
from render_service.render.render_config import build_render_config

# The baseline: the chunk that differs walked from its start (halved down to no less than a whole chunk)
COMPARISONS = {"halved": (bridge.common_prefix, bridge.common_suffix),
               "walked": (partial(bridge.common_prefix, linear=bridge._CHUNK),
                          partial(bridge.common_suffix, linear=bridge._CHUNK))}


def run(sizes: list[int], reps: int, answer: str) -> list[dict[str, Any]]:
    bundle = load_bundle(str(FIXTURE))
    config = build_render_config(dataclasses.replace(bundle, max_model_len=max(bundle.max_model_len, 262144)),
                                 served_model_names=["m"])
    from_body = body_renderer(config)
    encode = msgspec.json.encode
    masks = {"return_assistant_tokens_mask": True, "return_message_indices": True}
    plain = {"tools": TOOLS, "tool_choice": "none"}
    records = config.template.loop_records
    rows = []
    for size in sizes:
        messages = _conversation(size, config)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        k, before_k = assistants[-1], assistants[-2]
        completions = [config.tokenizer.encode(_sampled_text(messages[i])) for i in (before_k, k)]
        first = msgspec.json.decode(from_body(encode({"messages": messages[:before_k], **plain, **masks,
                                                      "return_prompt_ref": True})))
        before = encode({"messages": messages[:k], **plain, **masks, "return_prompt_ref": True, "previous_turn": {
            "prompt_ref": first["prompt_ref"], "completion_token_ids": completions[0]}})
        ref = msgspec.json.decode(from_body(before))["prompt_ref"]
        body = encode({"messages": messages, **plain, **masks, "previous_turn": {
            "prompt_ref": ref, "completion_token_ids": completions[1], "answer": answer}})
        timed: dict[str, list[float]] = {name: [] for name in COMPARISONS}
        answers: dict[str, Any] = {}
        for rep in range(reps):
            for name in sorted(COMPARISONS, reverse=rep % 2 == 1):
                turns.common_prefix, turns.common_suffix = COMPARISONS[name]
                if records is not None:
                    records.clear()
                from_body(before)
                start = time.thread_time()
                out = from_body(body)
                timed[name].append((time.thread_time() - start) * 1000)
                answers[name] = {key: value for key, value in msgspec.json.decode(out).items() if key != "request_id"}
        turns.common_prefix, turns.common_suffix = COMPARISONS["halved"]
        assert answers["halved"] == answers["walked"] and answers["halved"]["extend"]["extended"]
        medians = {name: statistics.median(values) for name, values in timed.items()}
        rows.append({"size": size, "messages": len(messages), "answer": answer, "reps": reps,
                     **{f"{name}_ms_median": ms for name, ms in medians.items()},
                     "halved_over_walked": medians["halved"] / medians["walked"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS / "mask_probe_compare.json"))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {"appended": run(sizes, args.reps, "appended"), "full": run(sizes, args.reps, "full")}
    write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
