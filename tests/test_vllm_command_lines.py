"""vLLM command lines start our servers unchanged, as real processes: flags that map onto ours work, the no-ops
are accepted and logged, what we cannot honour (-tp 2) is refused with one line, and a model id is found in
a Hugging Face cache laid out on disk (HF_HUB_OFFLINE=1: never the network)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.gateway_harness import Process, free_port
from tests.shared_paths import QWEN3_FIXTURE_DIR
from token_engine.models.arch import read_eos_token_ids
from token_engine.models.random_model import write_random_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENGINE = [sys.executable, "-m", "token_engine.cli", "serve"]
RENDER = [sys.executable, "-m", "render_service.cli", "serve"]


def cached_repo(hub: Path, repo_id: str) -> Path:
    """An empty snapshot of ``repo_id`` at main, laid out as huggingface_hub writes its cache."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    hub = tmp_path_factory.mktemp("hf") / "hub"
    write_random_model(cached_repo(hub, "Org/Tiny"), arch="qwen3", preset="tiny", dtype="float32",
                       overrides={"vocab_size": 1024, "tie_word_embeddings": False})
    tokenizer = cached_repo(hub, "Org/Qwen3-Tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_FIXTURE_DIR / name, tokenizer / name)
    shutil.copy(QWEN3_FIXTURE_DIR / "config.json", cached_repo(hub, "Org/Qwen3-Config") / "config.json")
    return hub


def offline_env(hub: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Runs the commands side by side (each imports torch: seconds apiece), bounded."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, env in commands]
    out = []
    for proc, (argv, _) in zip(procs, commands):
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out.append(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr))
    return out


def test_engine_refuses_what_it_cannot_honour_with_one_line(hub, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    (tmp_path / "corrupt").mkdir()
    shutil.copy(hub / "models--Org--Tiny" / "snapshots" / COMMIT / "config.json", tmp_path / "corrupt")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not safetensors")
    env = offline_env(hub)
    cases = {
        "-tp 2": (["Org/Tiny", "-tp", "2"], "--tensor-parallel-size 2 (-tp) is not supported"),
        "--tensor-parallel-size 2": (["Org/Tiny", "--tensor-parallel-size", "2"], "runs on one device"),
        "-pp 2": (["Org/Tiny", "-pp", "2"], "--pipeline-parallel-size 2"),
        "logprobs mode": (["Org/Tiny", "--logprobs-mode", "processed_logprobs"], "raw_logprobs"),
        "kv dtype": (["Org/Tiny", "--kv-cache-dtype", "float16"], "kept in the model dtype"),
        "missing dir": (["/nonexistent/model"], "model directory /nonexistent/model does not exist"),
        "not cached": (["Org/Missing"], "HF_HUB_OFFLINE is set"),
        "bad revision": (["Org/Tiny", "--revision", "v9"], "(revision v9)"),
        "no config": ([str(tmp_path / "empty")], "has no config.json"),
        "no weights": ([str(tmp_path / "no-weights")], "no safetensors weights"),
        "corrupt weights": ([str(tmp_path / "corrupt"), "--max-model-len", "64"], "SafetensorError"),
    }
    results = run_all([(ENGINE + argv, env) for argv, _ in cases.values()])
    for (name, (_, words)), result in zip(cases.items(), results):
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("token-engine: "), (name, result.stderr)
        assert words in lines[0], (name, lines[0])


def test_engine_names_the_side_channel_variable_when_its_port_is_taken(hub):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        env = {**offline_env(hub), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(taken.getsockname()[1])}
        kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
        (result,) = run_all([(ENGINE + ["Org/Tiny", "--max-model-len", "64", "--num-gpu-blocks-override", "32",
                                        "--block-size", "4", "--log-level", "warning", "--port", str(free_port()),
                                        "--kv-transfer-config", kv], env)])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("token-engine: ") and "VLLM_NIXL_SIDE_CHANNEL_PORT" in last, last


def test_engine_serves_a_cached_model_id_with_a_vllm_manifests_flags(hub, tmp_path):
    port = free_port()
    argv = ENGINE + [
        "Org/Tiny", "--revision", "main", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "64",
        "--num-gpu-blocks-override", "32", "--block-size", "4",
        # mapped onto ours
        "-tp", "1", "--tokenizer", "Org/Tiny", "--generation-config", "auto", "--scheduling-policy", "priority",
        "--enable-chunked-prefill", "--kv-cache-dtype", "float32", "--logprobs-mode", "raw_logprobs",
        "--enable-log-requests", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
        # derender's parsers (used only by output_mode derender); then accepted, no effect
        "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--trust-remote-code", "--enable-scale-out", "--disable-log-stats",
    ]
    server = Process(argv, port, offline_env(hub))  # waits (bounded) for /health
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "Org/Tiny"  # served by the id, as vLLM
            r = client.post("/inference/v1/generate", json={"token_ids": [1, 2, 3], "model": "Org/Tiny",
                                                            "request_id": "logged-1",
                                                            "sampling_params": {"max_tokens": 3, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 3
        log = server.log_tail(1 << 20)
    finally:
        server.stop()
    assert "Traceback" not in log, log
    for flag in ("--trust-remote-code", "--enable-scale-out", "--disable-log-stats"):
        assert f"{flag}: accepted for vLLM compatibility, no effect" in log, (flag, log)
    assert "received request_id=generate-tokens-logged-1" in log  # --enable-log-requests
    assert "POST /inference/v1/generate 200" not in log  # --disable-uvicorn-access-log (else an info line)


def test_generation_config_picks_the_eos_ids_as_vllm(tmp_path):
    model = write_random_model(tmp_path / "m", arch="qwen3", preset="tiny", dtype="float32")
    assert read_eos_token_ids(model, "auto") == [151645, 151643]  # generation_config.json first, then config.json
    assert read_eos_token_ids(model, "vllm") == [151645]  # config.json alone
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text('{"eos_token_id": [7]}')
    assert read_eos_token_ids(model, str(tmp_path / "gen")) == [7, 151645]
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_eos_token_ids(model, str(tmp_path))


def test_render_serves_a_cached_model_id_with_a_separate_tokenizer_and_vllm_flags(hub):
    port = free_port()
    argv = RENDER + ["Org/Qwen3-Config", "--tokenizer", "Org/Qwen3-Tokenizer", "--renderer-num-workers", "2",
                     "--trust-remote-code", "--uvicorn-log-level", "warning", "--host", "127.0.0.1",
                     "--port", str(port)]
    server = Process(argv, port, offline_env(hub))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "Org/Qwen3-Config"
            r = client.post("/tokenize", json={"model": "Org/Qwen3-Config", "prompt": "Hello world"})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == [9707, 1879]  # the Qwen3 tokenizer, from the --tokenizer repo
        log = server.log_tail(1 << 20)
    finally:
        server.stop()
    assert "Traceback" not in log, log
    assert "--trust-remote-code: accepted for vLLM compatibility, no effect" in log
    assert "--renderer-num-workers 2: serving with 2 worker processes" in log


def test_render_refuses_a_model_id_it_cannot_find_with_one_line(hub):
    (result,) = run_all([(RENDER + ["Org/Missing", "--port", str(free_port())], offline_env(hub))])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Org/Missing" in lines[0] and "HF_HUB_OFFLINE" in lines[0], result.stderr
