"""`make demo`'s program, run for real: the whole stack on the built-in default model."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.render_harness import QWEN3_DIR


def _run_demo(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "splitserve_demo", *args],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("all servers stopped.")
    return result.stdout


def _section(out: str, title: str) -> str:
    start = out.index(f"=== {title}")
    end = out.find("\n=== ", start + 1)
    return out[out.index("\n", start) + 1: end if end != -1 else len(out)]


def test_demo_starts_engine_and_gateway_on_the_default_model_and_shows_the_scripted_answer():
    out = _run_demo()
    assert "weights are CONSTRUCTED, not trained" in out and "--model-dir Qwen/Qwen3-0.6B" in out
    assert "What's the weather like in Paris today?<|im_end|>\\n<|im_start|>assistant\\n" in out
    want = {"reasoning": "The user wants Paris weather; only a live lookup knows that, so I call the tool.",
            "content": "Checking its forecast now:"}
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}

    generated = json.loads(_section(out, "2. generate:"))["choices"][0]
    assert generated["finish_reason"] == "stop" and generated["token_ids"].startswith("42 ids:")
    split = json.loads(_section(out, "3. derender:"))
    completion = json.loads(_section(out, "gateway: POST /v1/chat/completions"))
    for choice in (split, completion["choices"][0]):
        message = choice["message"]
        assert {k: message[k] for k in want} == want and choice["finish_reason"] == "tool_calls"
        [tool_call] = message["tool_calls"]
        assert tool_call["function"]["name"] == call["name"]
        assert json.loads(tool_call["function"]["arguments"]) == call["arguments"]

    streamed = json.loads(_section(out, "gateway: the same request streamed").split("\n\nThe default model")[0])
    assert {k: streamed[k] for k in want} == want and streamed["finish_reason"] == "tool_calls"
    deltas = streamed["tool_calls (deltas)"]
    assert deltas[0]["function"]["name"] == call["name"]
    assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == call["arguments"]
    assert streamed["usage"]["completion_tokens"] == completion["usage"]["completion_tokens"] == 42


def test_demo_on_a_bundle_without_weights_runs_the_render_tier_alone():
    out = _run_demo("--model-dir", str(QWEN3_DIR))
    assert "has no weights: starting the render tier alone" in out
    assert "=== 1. render:" in out
    assert "=== 2. generate" not in out and "=== gateway" not in out
    assert "CONSTRUCTED" not in out
