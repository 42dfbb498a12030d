"""`token-engine make-random-model` and `token-engine serve` as real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from token_engine.cli import build_parser, engine_config_from_args, main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_flags_use_vllm_names_and_reach_the_engine_config():
    args = build_parser().parse_args([
        "serve", "/m", "--device", "cpu", "--port", "9", "--served-model-name", "a", "b", "--max-model-len", "64",
        "--max-num-seqs", "3", "--block-size", "8", "--gpu-memory-utilization", "0.5",
        "--num-gpu-blocks-override", "40", "--max-num-batched-tokens", "32", "--dtype", "float32", "--seed", "7",
        "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "--no-enable-prefix-caching",
    ])
    cfg = engine_config_from_args(args)
    assert (cfg.model, cfg.served_model_name, cfg.max_model_len, cfg.max_num_seqs, cfg.block_size) == \
        ("/m", "a", 64, 3, 8)
    assert (cfg.gpu_memory_utilization, cfg.num_gpu_blocks_override, cfg.max_num_batched_tokens) == (0.5, 40, 32)
    assert (cfg.dtype, cfg.seed, cfg.enable_prefix_caching) == ("float32", 7, False)
    assert cfg.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("bad", [["--kv-transfer-config", "{nope"], ["--kv-transfer-config", "[1]"],
                                 ["--block-size", "0"], ["--device", "tpu"]])
def test_bad_serve_flags_exit_with_a_usage_error(bad):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/m", *bad])
    assert exc.value.code == 2


def test_make_random_model_then_serve_then_generate_then_terminate(tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    cli = os.path.join(bin_dir, "token-engine")
    model_dir = tmp_path / "model"
    # In-process: the same main() the console script calls, without a second torch import.
    assert main(["make-random-model", str(model_dir), "--arch", "qwen3", "--preset", "tiny", "--dtype", "float32",
                 "--overrides", '{"vocab_size": 1024, "tie_word_embeddings": false}']) == 0
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 1024

    port = _free_port()
    proc = subprocess.Popen(
        [cli, "serve", str(model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "tiny", "--max-model-len", "64", "--num-gpu-blocks-override", "32",
         "--block-size", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(600):  # bounded wait for startup (torch import + model load)
                if proc.poll() is not None:
                    break
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            assert proc.poll() is None, proc.stdout.read().decode()
            r = client.post("/inference/v1/generate", json={"token_ids": [1, 2, 3], "model": "tiny",
                                                            "sampling_params": {"max_tokens": 4, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 4
            r = client.post("/inference/v1/generate", json={"token_ids": [5000], "sampling_params": {}})
            assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = proc.stdout.read().decode()
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM, not a SIGKILL.
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Traceback" not in output, output
