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


def test_demo_starts_engine_and_gateway_on_the_default_model_and_gets_completions():
    out = _run_demo()
    assert "<|im_start|>user\\nWhat's the capital of Korea?<|im_end|>" in out
    derendered = json.loads(_section(out, "derender:"))
    message = derendered["choices"][0]["message"]
    assert message["reasoning"] == "\nThe user asks for the capital of South Korea. That is Seoul.\n"
    assert message["content"] == "\n\nThe capital of South Korea is Seoul."

    completion = json.loads(_section(out, "gateway: POST /v1/chat/completions"))
    assert completion["object"] == "chat.completion"
    assert completion["usage"]["completion_tokens"] == 16
    assert completion["choices"][0]["finish_reason"] == "length"
    streamed = _section(out, "gateway: the same request streamed").split("\n\nall servers stopped.")[0]
    assert streamed.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":16' in streamed


def test_demo_on_a_bundle_without_weights_runs_the_render_tier_alone():
    out = _run_demo("--model-dir", str(QWEN3_DIR))
    assert "has no weights: starting the render tier alone" in out
    assert "=== derender:" in out
    assert "=== gateway" not in out
