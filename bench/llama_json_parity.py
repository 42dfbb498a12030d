"""llama3_json / llama4_json: our chat derender against vLLM 0.34's, batch and streaming, case by case.

vLLM 0.34 moved both parsers onto its declarative parser engine (``vllm/parser/llama_json.py``). This feeds the
same model outputs, as token ids of a Llama 3.1 and a Llama 4 test tokenizer (``tests/family_bundles.py``: Llama
3's real BPE ranks with each model's special tokens at their ids), through both derenders: ours in-process
(``derender_chat``, and ``derender_chat_stream`` one token per chunk with ``stream_state`` round-tripped), vLLM's
in a subprocess under vLLM's own Python (``bench/vllm_derender_side.py``: its ``OnlineDerenderer`` batch path,
and its streaming path one token per chunk with its ``DerenderStreamState`` round-tripped through JSON). A case
is ``same`` when content, finish_reason, the calls' names and their arguments' bytes agree; ``argument bytes``
marks arguments that are JSON-equal but spelled differently.

    SPLITSERVE_VLLM034_SRC=DIR python -m bench.llama_json_parity --vllm-python VENV/bin/python \\
        --out bench/results/llama_json_parity.json

``DIR`` holds vLLM 0.34's unpacked wheel (its Python files; the compiled extensions are not needed), put first
on the path of a Python that has vLLM's dependencies (a vLLM 0.33 venv has them). The table (docs/compatibility.md
"llama3_json / llama4_json against upstream's parser engine") is printed as Markdown.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from bench.portable import write_result

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time", "search", "write_file")]
W = '{"name": "get_weather", "parameters": {"city": "San Francisco"}}'
T = '{"name": "get_time", "parameters": {}}'

# name -> (model output, finish_reason); "stop" outputs end with the model's end-of-turn token
CASES: dict[str, tuple[str, str]] = {
    "single call": (W, "stop"),
    "single call, arguments key": ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', "stop"),
    "python_tag prefix": ("<|python_tag|>" + W, "stop"),
    "parallel calls, '; '": (W + "; " + T, "stop"),
    "parallel calls, ';' no space": (W + ";" + T, "stop"),
    "parallel calls after python_tag": ("<|python_tag|>" + W + "; " + T, "stop"),
    "parallel calls, ' ; '": (W + " ; " + T, "stop"),
    "python_tag then code, no JSON": ('<|python_tag|>print("hello")', "stop"),
    "object with a name and no arguments key": ('{"name": "John", "age": 30}', "stop"),
    "object without a name": ('{"parameters": {"x": 1}}', "stop"),
    # the shape Llama 4's chat template gives calls in the history: the message's text, then the calls back to back
    "Llama 4 template shape": ("<|python_start|>Checking.<|python_end|>" + W + T, "stop"),
    "calls back to back": (W + T, "stop"),
    "call then text": (T + " and then some prose", "stop"),
    "call, ';', then text": (T + "; done", "stop"),
    "text before a call": ("Sure! " + W, "stop"),
    "text before python_tag and a call": ("Let me check. <|python_tag|>" + W, "stop"),
    "calls separated by a newline": (W + "\n" + T, "stop"),
    "compact JSON spacing": ('{"name":"get_weather","parameters":{"city":"Oslo","days":2}}', "stop"),
    "leading newline": ("\n" + T, "stop"),
    "plain text": ("The weather in Paris is sunny.", "stop"),
    "JSON that is not a call": ('{"answer": 42, "note": "not a call"}', "stop"),
    "call without arguments key": ('{"name": "get_time"}', "stop"),
    "malformed arguments": ('{"name": "get_weather", "parameters": {"city": "Paris", oops}} more', "stop"),
    "missing closing brace": ('{"name": "get_weather", "parameters": {"city": "Paris"}', "stop"),
    "cut by max_tokens": ('{"name": "get_weather", "parameters": {"city": "Par', "length"),
    "second call cut by max_tokens": (T + '; {"name": "get_weather", "parameters": {"city": "Ber', "length"),
    "cut before the arguments": ('{"name": "get_weather", "param', "length"),
    "nested arguments": (json.dumps({"name": "search", "parameters": {
        "q": "x", "filter": {"a": {"b": [1, {"c": "}"}]}}}}), "stop"),
    "string with braces, ';' and quotes": (json.dumps({"name": "write_file", "parameters": {
        "content": 'x } { ; \\" "q"'}}), "stop"),
    "unicode arguments": ('{"name": "get_weather", "parameters": {"city": "東京 😀"}}', "stop"),
    "escaped unicode arguments": ('{"name": "get_weather", "parameters": {"city": "\\u6771\\u4eac"}}', "stop"),
    "arguments as a JSON string": ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', "stop"),
}

# family -> (tool parser, test bundle, end-of-turn token, the model's EOS ids)
FAMILIES = {
    "llama3_json": ("llama3", 128009, [128001, 128008, 128009]),
    "llama4_json": ("llama4", 200008, [200001, 200007, 200008]),
}


@functools.cache
def _config(bundle_dir: Path, parser: str) -> Any:
    from render_service.bundle.model_bundle import load_bundle
    from render_service.render.render_config import build_render_config

    return build_render_config(load_bundle(str(bundle_dir)), served_model_names=["m"], tool_call_parser=parser,
                               enable_auto_tool_choice=True)


def _ours(bundle_dir: Path, parser: str, ids: list[int], finish: str) -> dict[str, Any]:
    from render_service.derender.batch import derender_chat
    from render_service.derender.stream import derender_chat_stream
    from render_service.streaming_cache.session import StreamRuntime
    from render_service.wire.protocol import (
        ChatCompletionRequest,
        DerenderChatRequest,
        DerenderChatStreamRequest,
        GenerateResponse,
        GenerateResponseChoice,
        GenerateStreamChoice,
        GenerateStreamResponse,
    )

    cfg = _config(bundle_dir, parser)
    request = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                               "tool_choice": "auto"}, ChatCompletionRequest)
    choice = derender_chat(DerenderChatRequest(
        generate_response=GenerateResponse(request_id="r", choices=[GenerateResponseChoice(
            token_ids=ids, finish_reason=finish)]), prompt_token_ids=[], chat_request=request), cfg).choices[0]
    message = msgspec.to_builtins(choice.message)
    batch = {"content": message.get("content"), "finish_reason": choice.finish_reason,
             "tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                            for c in message.get("tool_calls") or []]}
    runtime = StreamRuntime(secret="parity")
    state: Any = None
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    stream_finish = None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = derender_chat_stream(DerenderChatStreamRequest(
            stream=True, generate_chunk=GenerateStreamResponse(request_id="r", choices=[GenerateStreamChoice(
                token_ids=[token], finish_reason=finish if last else None)]),
            stream_state=state, prompt_token_ids=[], chat_request=request), cfg, runtime)
        state = json.loads(msgspec.json.encode(out.stream_state))  # over the wire
        delta = msgspec.to_builtins(out.chunk.choices[0])
        if delta["delta"].get("content"):
            content.append(delta["delta"]["content"])
        for tc in delta["delta"].get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            fn = tc.get("function") or {}
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments") or ""
        stream_finish = delta.get("finish_reason") or stream_finish
    stream = {"content": "".join(content) or None, "finish_reason": stream_finish,
              "tool_calls": [calls[i] for i in sorted(calls)]}
    return {"batch": batch, "stream": stream}


def _vllm(python: str, source: str | None, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = source + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([python, str(REPO / "bench" / "vllm_derender_side.py")], input=json.dumps(spec),
                         capture_output=True, text=True, env=env, timeout=900, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"vLLM side failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _json_or_text(raw: str) -> Any:
    try:
        return ("json", json.loads(raw))
    except ValueError:
        return ("text", raw)


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two folded answers (empty: the same)."""
    if "error" in a or "error" in b:
        return ["error"] if a.get("error") != b.get("error") else []
    diffs = [k for k in ("content", "finish_reason") if a.get(k) != b.get(k)]
    ca, cb = a["tool_calls"], b["tool_calls"]
    if [c["name"] for c in ca] != [c["name"] for c in cb]:
        diffs.append("calls")
    elif [_json_or_text(c["arguments"]) for c in ca] != [_json_or_text(c["arguments"]) for c in cb]:
        diffs.append("arguments")
    elif [c["arguments"] for c in ca] != [c["arguments"] for c in cb]:
        diffs.append("argument bytes")  # JSON-equal
    return diffs


def _summary(side: dict[str, Any]) -> str:
    if "error" in side:
        return "error: " + side["error"][:60]
    parts = [f'{c["name"]}({c["arguments"]})' for c in side["tool_calls"]]
    if side["content"] is not None:
        parts.append("content " + json.dumps(side["content"], ensure_ascii=False))
    return "; ".join(parts) or "nothing"


def _cell(side: dict[str, Any]) -> str:
    return _summary(side).replace("|", "\\|")


def table(results: dict[str, Any]) -> str:
    lines = ["| parser | case | mode | vLLM 0.34 | ours | |", "|---|---|---|---|---|---|"]
    for parser, cases in results["cases"].items():
        for name, row in cases.items():
            for mode in ("batch", "stream"):
                diffs = row["diff"][mode]
                verdict = "same" if not diffs else "differs: " + ", ".join(diffs)
                lines.append(f"| {parser} | {name} | {mode} | {_cell(row['vllm'][mode])} | "
                             f"{_cell(row['ours'][mode])} | {verdict} |")
    return "\n".join(lines)


def run(python: str, source: str | None, only: list[str] | None = None) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from tests.family_bundles import write_family_bundle

    root = Path(tempfile.mkdtemp(prefix="llama-json-parity-"))
    results: dict[str, Any] = {"what": "answers compared, no timings", "machine": platform.platform(),
                               "cases": {}}
    for parser, (family, end, eos_ids) in FAMILIES.items():
        bundle = write_family_bundle(family, root / family)
        tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
        token_ids = {name: tok.encode(text, add_special_tokens=False).ids + ([end] if finish == "stop" else [])
                     for name, (text, finish) in CASES.items() if not only or name in only}
        spec = {"tokenizer_dir": str(bundle), "tool_parser": parser, "eos_ids": eos_ids, "tools": TOOLS,
                "cases": [{"name": n, "token_ids": ids, "finish_reason": CASES[n][1]} for n, ids in token_ids.items()]}
        theirs = _vllm(python, source, spec)
        results["vllm_version"] = theirs["vllm_version"]
        rows = results["cases"][parser] = {}
        for name, ids in token_ids.items():
            ours = _ours(bundle, parser, ids, CASES[name][1])
            vllm = theirs["results"][name]
            rows[name] = {"output": CASES[name][0], "finish_reason": CASES[name][1], "token_ids": len(ids),
                          "vllm": vllm, "ours": ours,
                          "diff": {m: compare(vllm[m], ours[m]) for m in ("batch", "stream")}}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("SPLITSERVE_VLLM034_PYTHON"),
                    help="a Python with vLLM's dependencies (default $SPLITSERVE_VLLM034_PYTHON)")
    ap.add_argument("--vllm-source", default=os.environ.get("SPLITSERVE_VLLM034_SRC"),
                    help="vLLM 0.34's unpacked wheel, put first on its path (default $SPLITSERVE_VLLM034_SRC)")
    ap.add_argument("--case", action="append", help="run only these cases")
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    args = ap.parse_args()
    if not args.vllm_python:
        raise SystemExit("--vllm-python (or $SPLITSERVE_VLLM034_PYTHON) is required")
    results = run(args.vllm_python, args.vllm_source, args.case)
    if args.out:
        write_result(args.out, results)
    print(table(results))
    sys.exit(0)


if __name__ == "__main__":
    main()
