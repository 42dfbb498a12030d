"""``vllm bench serve`` (vLLM 0.32's own benchmark client) runs unchanged against the gateway: its `openai-chat`
and `openai` backends, the random dataset (token ids drawn from the model's tokenizer), every request completed
with the output length asked for. A real engine and gateway over a tiny random Qwen3; skips without the peer.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench import peers
from tests.gateway_harness import QWEN3_TOKENIZER, engine_process, gateway_process
from tests.vllm_peers import VLLM032, needs_vllm032
from token_engine.models.random_model import write_random_model

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 8


@needs_vllm032
@pytest.mark.slow  # two vLLM client runs (~15 s of imports each) on a shared 2-core machine
@pytest.mark.parametrize("backend,endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")])
def test_vllm_bench_serve_completes_every_request_through_the_gateway(tmp_path, backend, endpoint):
    model = write_random_model(tmp_path / "tiny", arch="qwen3", preset="tiny", tokenizer_dir=QWEN3_TOKENIZER,
                               dtype="float32")
    engine = engine_process(model, max_model_len=256)
    gateway = gateway_process(model, ["--engine", engine.url])
    try:
        cmd = [str(VLLM032 / "bin" / "python"), str(peers.PEER_RECIPE / "vllm_cpu_cli.py"), "bench", "serve",
               "--backend", backend, "--endpoint", endpoint, "--base-url", gateway.url, "--model", "tiny",
               "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
               "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # the lengths it asked for, counted by it
        assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    finally:
        gateway.stop()
        engine.stop()
