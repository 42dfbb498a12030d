"""`make demo`'s program, run for real against the Qwen3 fixture bundle."""

from __future__ import annotations

import subprocess
import sys

from tests.render_harness import QWEN3_DIR


def test_demo_renders_then_derenders_and_stops_its_server():
    result = subprocess.run([sys.executable, "-m", "render_service.demo", "--model-dir", str(QWEN3_DIR)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "=== render: chat -> GenerateRequest" in out
    assert "<|im_start|>user\\nWhat's the capital of Korea?<|im_end|>" in out
    assert '"content": "\\n\\nThe capital of South Korea is Seoul."' in out
    assert '"reasoning": "\\nThe user asks for the capital of South Korea. That is Seoul.\\n"' in out
    assert out.rstrip().endswith("render server stopped.")
