"""The message memo (render_service/wire/message_memo.py), on against off, in this process, one run.

The request is the last turn of a growing agent trace (``agent_render_bench.LastTurn``: the trace that
``agent_render_bench --profile-only`` profiles) at each of --sizes prompt tokens. Stages, each timed with the memo
off (``render_cache_bytes 0``'s path: ``server.decode`` into ChatCompletionRequest) and on, in one process, the
two taking turns repeat by repeat so that both see the same machine load; a figure is the best thread-CPU time
(ms) over --repeats:
  decode_prepare  decode the body, then prepare_messages + convert_developer_role + prepare_tools (what the chat
                  template takes). On: the memo holds the turn before (the agent's previous request), so the
                  turn's earlier messages and its tools are hits and its new messages misses.
  all_hits        the same with the memo holding this turn already (the body sent again).
  first_turn      the same with an empty memo (every message a miss): what a conversation's first request, or
                  one the memo no longer holds, costs against no memo.
  whole_job       the /render job: decode + render_chat + the response's JSON (server._encode_generate_request);
                  the memo as in decode_prepare, the prompt encoder holding the turn before in both.
  first_turn_whole_job  the same job with the memo and the prompt encoder empty (every piece tokenized).
Ratios: off / on (above 1: the memo saves), and the first turns' on / off (the price of a miss). A third side,
"bodies", is the memo with its recent bodies as the server runs it (body_prefix_store.py: the previous turn's body
kept, so the turn's earlier messages are neither decoded nor scanned), in decode_prepare and whole_job.

usage: python -m bench.message_memo_bench [--sizes 8192,32768,131072] [--repeats 30]
Results: bench/results/message_memo_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from bench import peers
from bench.agent_render_bench import MODEL, LastTurn, git_commit
from bench.agent_trace import chat_body
from bench.portable import write_result

RESULTS = peers.REPO / "bench" / "results"


def measure_size(size: int, repeats: int) -> dict[str, Any]:
    from render_service.http.server import _encode_generate_request, decode
    from render_service.render.render import render_chat
    from render_service.templates.chat_messages import convert_developer_role, prepare_messages, prepare_tools
    from render_service.tokenize.incremental_tokenizer import IncrementalEncoder
    from render_service.wire.message_memo import MessageMemo, decode_chat_request
    from render_service.wire.protocol import ChatCompletionRequest

    turn = LastTurn(size)
    config, template, body = turn.config, turn.template, turn.body
    memo_bytes = config.message_memo.max_bytes
    before = turn.messages[:max(e for e in turn.ends if e < len(turn.messages))]
    before_body = msgspec.json.encode(chat_body(MODEL, before, turn.tools))
    before_text = template.render(convert_developer_role(prepare_messages(before, template.content_format),
                                                         template), tools=prepare_tools(turn.tools),
                                  add_generation_prompt=True)

    def decode_prepare(memo: MessageMemo | None, data: bytes) -> None:
        req = decode_chat_request(data, memo, decode)
        convert_developer_role(prepare_messages(req.messages, template.content_format), template)
        prepare_tools(req.tools)

    def warm_memo(body_bytes: int = 0) -> MessageMemo:
        memo = MessageMemo(memo_bytes, body_bytes)
        decode_prepare(memo, before_body)
        return memo

    def seen_turn() -> MessageMemo:
        memo = warm_memo()
        decode_prepare(memo, body)
        return memo

    def turn_cache(memo: MessageMemo | None) -> None:
        config.message_memo = memo
        config.prompt_encoder = IncrementalEncoder(config.tokenizer)
        config.prompt_encoder.encode(before_text)

    def cold(memo: MessageMemo | None) -> None:
        config.message_memo = memo
        config.prompt_encoder = IncrementalEncoder(config.tokenizer)

    def whole_job() -> None:
        _encode_generate_request(render_chat(decode_chat_request(body, config.message_memo, decode), config,
                                             ids_view=True))

    # (setup untimed, timed): each returns what the timed part needs
    stages: dict[str, dict[str, tuple[Any, Any]]] = {
        "decode_prepare": {"off": (lambda: None, lambda m: decode_prepare(None, body)),
                           "on": (warm_memo, lambda m: decode_prepare(m, body)),
                           "bodies": (lambda: warm_memo(memo_bytes), lambda m: decode_prepare(m, body))},
        "all_hits": {"off": (lambda: None, lambda m: decode_prepare(None, body)),
                     "on": (seen_turn, lambda m: decode_prepare(m, body))},
        "first_turn": {"off": (lambda: None, lambda m: decode_prepare(None, body)),
                       "on": (lambda: MessageMemo(memo_bytes), lambda m: decode_prepare(m, body))},
        "whole_job": {"off": (lambda: turn_cache(None), lambda m: whole_job()),
                      "on": (lambda: turn_cache(warm_memo()), lambda m: whole_job()),
                      "bodies": (lambda: turn_cache(warm_memo(memo_bytes)), lambda m: whole_job())},
        "first_turn_whole_job": {"off": (lambda: cold(None), lambda m: whole_job()),
                                 "on": (lambda: cold(MessageMemo(memo_bytes)), lambda m: whole_job())},
    }
    # the same ids either way, before any timing
    reference = decode(body, ChatCompletionRequest)
    turn_cache(None)
    want = list(render_chat(reference, config).token_ids)
    turn_cache(warm_memo())
    if list(render_chat(decode_chat_request(body, config.message_memo, decode), config).token_ids) != want:
        raise SystemExit("token ids differ with the memo; refusing to time")

    best: dict[str, dict[str, float]] = {stage: dict.fromkeys(sides, float("inf")) for stage, sides in stages.items()}
    for repeat in range(repeats):
        for stage, sides in stages.items():
            names = list(sides)
            for side in names[repeat % len(names):] + names[:repeat % len(names)]:  # each side first in turn
                setup, timed = sides[side]
                state = setup()
                started = time.thread_time()
                timed(state)
                spent = time.thread_time() - started
                best[stage][side] = min(best[stage][side], spent)
    ms = {stage: {side: round(1e3 * v, 3) for side, v in sides.items()} for stage, sides in best.items()}
    return {
        "prompt_tokens": len(want), "messages": len(turn.messages), "body_bytes": len(body),
        "new_messages_in_turn": len(turn.messages) - len(before),
        "new_message_bytes_in_turn": sum(len(msgspec.json.encode(m)) for m in turn.messages[len(before):]), "ms": ms,
        "ratios": {
            "decode_prepare_off_over_on": round(ms["decode_prepare"]["off"] / ms["decode_prepare"]["on"], 2),
            "all_hits_off_over_on": round(ms["all_hits"]["off"] / ms["all_hits"]["on"], 2),
            "whole_job_off_over_on": round(ms["whole_job"]["off"] / ms["whole_job"]["on"], 3),
            "decode_prepare_on_over_bodies": round(ms["decode_prepare"]["on"] / ms["decode_prepare"]["bodies"], 2),
            "whole_job_on_over_bodies": round(ms["whole_job"]["on"] / ms["whole_job"]["bodies"], 3),
            "whole_job_off_over_bodies": round(ms["whole_job"]["off"] / ms["whole_job"]["bodies"], 3),
            "first_turn_on_over_off": round(ms["first_turn"]["on"] / ms["first_turn"]["off"], 3),
            "first_turn_whole_job_on_over_off": round(ms["first_turn_whole_job"]["on"]
                                                      / ms["first_turn_whole_job"]["off"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--note", default="", help="what to record about the machine (shared? load?)")
    ap.add_argument("--out", type=Path, default=RESULTS / "message_memo_bench.json")
    args = ap.parse_args(argv)
    results = {str(size): measure_size(int(size), args.repeats) for size in args.sizes.split(",")}
    out = {
        "bench": "message_memo_bench", "commit": git_commit(peers.REPO), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "note": args.note},
        "command": "python -m bench.message_memo_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": args.repeats, "sizes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(json.dumps({size: {**r["ms"], **r["ratios"]} for size, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
