"""Per-family streaming derender cost, in-process: microseconds per token for each reasoning + tool parser
family, next to qwen3 + hermes (the baseline), in one run.

Each family's output has the same shape and size: a third reasoning, a third content, a third one tool call
whose string argument is long (so the tool parser's per-token path inside a value is what is measured), in
the family's own markup and spelled with its tokenizer (Qwen3's for hermes / qwen3_coder / qwen3_xml; for
GLM, MiniMax-M2 and Seed-OSS the test tokenizers of tests/family_bundles.py: Qwen3's BPE with the family's
special tokens). The pipeline is fed one token per call (the streaming path), best of ``--repeat`` runs.
The acceptance line: no family costs more than 2x hermes.

    .venv/bin/python -m bench.parser_families_bench --tokens 2000

Results: bench/results/parser_families_bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REASONING = ("I need the weather for Seoul, so the get_weather tool is the right call; I will pass the city "
             "and a note and then summarise humidity, wind and rain chances in plain words. ")
CONTENT = ("The forecast for Seoul: clear skies in the morning, clouds after noon, 21°C at the warmest and "
           "a light north-west breeze. Rain is unlikely before Friday. ")
NOTE = "Bring an umbrella 🌧 just in case; \"quotes\", back\\slashes and <b>tags</b> stay text. "


def call_text(family: str, note: str) -> str:
    if family == "hermes":
        return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Seoul", "note": note}},
                                            ensure_ascii=False) + "\n</tool_call>"
    if family in ("qwen3_coder", "qwen3_xml"):
        return (f"<tool_call>\n<function=get_weather>\n<parameter=city>\nSeoul\n</parameter>\n<parameter=note>\n"
                f"{note}\n</parameter>\n</function>\n</tool_call>")
    if family in ("glm45", "glm47"):
        return (f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seoul</arg_value>\n"
                f"<arg_key>note</arg_key>\n<arg_value>{note}</arg_value>\n</tool_call>")
    if family == "minimax_m2":
        return (f'<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Seoul</parameter>\n'
                f'<parameter name="note">{note}</parameter>\n</invoke>\n</minimax:tool_call>')
    if family == "seed_oss":
        return (f"<seed:tool_call>\n<function=get_weather>\n<parameter=city>Seoul</parameter>\n"
                f"<parameter=note>{note}</parameter>\n</function>\n</seed:tool_call>")
    raise ValueError(family)


# family -> (reasoning parser, think open, think close, tokenizer bundle)
FAMILIES = {
    "hermes": ("qwen3", "<think>\n", "\n</think>\n\n", "qwen3"),
    "qwen3_coder": ("qwen3", "<think>\n", "\n</think>\n\n", "qwen3"),
    "qwen3_xml": ("qwen3", "<think>\n", "\n</think>\n\n", "qwen3"),
    "glm45": ("glm45", "<think>", "</think>\n", "glm45"),
    "glm47": ("glm47", "<think>", "</think>", "glm45"),
    "minimax_m2": ("minimax_m2", "<think>\n", "\n</think>\n\n", "minimax_m2"),
    "seed_oss": ("seed_oss", "<seed:think>", "</seed:think>", "seed_oss"),
}


def tokenizers(root: Path) -> dict:
    from render_service.bundle import load_bundle
    from tests.family_bundles import write_family_bundle
    from tests.shared_paths import QWEN3_FIXTURE_DIR

    out = {"qwen3": load_bundle(QWEN3_FIXTURE_DIR).tokenizer}
    for name in ("glm45", "minimax_m2", "seed_oss"):
        out[name] = load_bundle(write_family_bundle(name, root / name)).tokenizer
    return out


def build_output(tok, family: str, n: int) -> list[int]:
    _, open_tag, close_tag, _ = FAMILIES[family]
    third = n // 3
    reasoning = tok.encode(REASONING * (third // 20 + 2))[:third]
    content = tok.encode(CONTENT * (third // 20 + 2))[:third]
    note_ids = tok.encode(NOTE * (third // 10 + 2))
    head = tok.encode(open_tag) + reasoning + tok.encode(close_tag) + content
    lo, hi = 0, len(note_ids)
    while lo < hi:  # the longest note that keeps the call within n tokens
        mid = (lo + hi + 1) // 2
        if len(head) + len(tok.encode(call_text(family, tok.decode(note_ids[:mid])))) <= n:
            lo = mid
        else:
            hi = mid - 1
    return head + tok.encode(call_text(family, tok.decode(note_ids[:lo])))


def measure(tok, family: str, ids: list[int], repeat: int) -> float:
    from render_service.parsers.base import ToolSpec
    from render_service.parsers.pipeline import Pipeline, PipelineConfig

    tools = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "note": {"type": "string"}}})]
    pipeline = Pipeline(tok, PipelineConfig(request_id="bench", reasoning_parser=FAMILIES[family][0],
                                            tool_parser=family, tool_choice="auto", tools=tools,
                                            skip_special_tokens=False))
    best = float("inf")
    for _ in range(repeat):
        state = pipeline.initial_state()
        t0 = time.process_time()
        for t in ids:
            pipeline.feed(state, [t])
        pipeline.finish(state)
        best = min(best, time.process_time() - t0)
    return 1e6 * best / len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/parser_families_bench.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        toks = tokenizers(Path(tmp))
    rows = {}
    # interleaved rounds, so that machine load drifting during the run hits every family alike
    outputs = {f: build_output(toks[FAMILIES[f][3]], f, args.tokens) for f in FAMILIES}
    for f in FAMILIES:
        rows[f] = {"tokens": len(outputs[f]), "us_per_token": float("inf")}
    for _ in range(args.repeat):
        for f in FAMILIES:
            us = measure(toks[FAMILIES[f][3]], f, outputs[f], 1)
            rows[f]["us_per_token"] = min(rows[f]["us_per_token"], us)
    base = rows["hermes"]["us_per_token"]
    for row in rows.values():
        row["us_per_token"] = round(row["us_per_token"], 2)
        row["vs_hermes"] = round(row["us_per_token"] / base, 2)
    result = {
        "bench": "parser_families_bench",
        "machine": platform.node(),
        "python": platform.python_version(),
        "tokens": args.tokens,
        "repeat": args.repeat,
        "families": rows,
        "max_vs_hermes": max(r["vs_hermes"] for r in rows.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["max_vs_hermes"] <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
