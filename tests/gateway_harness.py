"""Pieces shared by the gateway tests: a tiny Qwen3 model that follows scripts, and real server processes.

A random model says nothing a tool or reasoning parser would recognise, so the model written here is
random-weight everywhere except that it follows fixed token chains: every attention and MLP output
projection is zero (each layer is the identity on the residual stream), each chain token's embedding
is a distinct basis vector, and the lm_head row of its successor points at that vector. Greedy (and
any sane temperature) decoding then walks the chain from whatever token ends the prompt. Chains must
not repeat a token (a bigram model cannot tell two occurrences apart).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from tests.shared_paths import FIXTURES as FIXTURES_DIR
from token_engine.models.random_model import write_random_model

FIXTURES = FIXTURES_DIR
if not FIXTURES.exists():  # a clean checkout carries its own copy
    FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
QWEN3_TOKENIZER = FIXTURES / "qwen3-0.6b"

IM_END = 151645
THINKING_PROMPT_END = 198  # "\n" after "<|im_start|>assistant" (enable_thinking on)
PLAIN_PROMPT_END = 271  # "\n\n" after the empty think block (enable_thinking off)
LOOP_START = 7141  # "alpha": the completions prompt "... alpha" loops forever

# <think>Need weather</think><tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}</tool_call><|im_end|>
TOOL_SCRIPT = [151667, 23657, 9104, 151668, 151657, 4913, 606, 788, 330, 455, 69364, 2198, 16370, 22317, 8926,
               3252, 59604, 30975, 151658, IM_END]
# Hello world, the sky is blue today and birds sing.<|im_end|>
PLAIN_SCRIPT = [9707, 1879, 11, 279, 12884, 374, 6303, 3351, 323, 19654, 7780, 13, IM_END]
PLAIN_TEXT = "Hello world, the sky is blue today and birds sing."
# " beta gamma delta" and back to " beta": never ends by itself
LOOP_SCRIPT = [13440, 21619, 9477]

CHAINS = [
    [THINKING_PROMPT_END, *TOOL_SCRIPT],
    [PLAIN_PROMPT_END, *PLAIN_SCRIPT],
    [LOOP_START, *LOOP_SCRIPT, LOOP_SCRIPT[0]],
]


def write_passthrough_qwen3(out_dir) -> tuple[Path, dict]:
    """A tiny float32 Qwen3 directory (real Qwen3 tokenizer) whose layers add nothing to the residual stream
    (o and down projections zero, norms one), so its logits are lm_head @ norm(embedding of the last token).
    Returns the directory and its tensors, for the caller to script the embedding and head and save_scripted."""
    out = write_random_model(out_dir, arch="qwen3", preset="tiny", overrides={"tie_word_embeddings": False},
                             tokenizer_dir=QWEN3_TOKENIZER, dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            t.zero_()
        if name.endswith("norm.weight"):
            t.fill_(1.0)
    return out, tensors


def save_scripted(out: Path, tensors: dict) -> Path:
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_scripted_qwen3(out_dir, chains: list[list[int]] = CHAINS) -> Path:
    """A tiny float32 Qwen3 directory (with the real Qwen3 tokenizer) that follows ``chains``."""
    out, tensors = write_passthrough_qwen3(out_dir)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    head.zero_()  # only chain successors can win; ties elsewhere resolve to one fixed token
    nodes = sorted({t for chain in chains for t in chain})
    assert len(nodes) <= hidden, "more chain tokens than hidden dimensions"
    axis = {t: i for i, t in enumerate(nodes)}
    for t in nodes:
        embed[t].zero_()
        embed[t][axis[t]] = 1.0
    for chain in chains:
        for a, b in zip(chain, chain[1:]):
            head[b][axis[a]] = 4.0  # after the final RMSNorm the axis is sqrt(hidden): logit 32 vs 0
    return save_scripted(out, tensors)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A real server process on a loopback port; waits (bounded) for /health."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None, wait: bool = True):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        # stderr to a file, not a pipe: nobody drains a pipe while the server runs, and a full one stalls it
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.DEVNULL, stderr=self.log)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, limit_s: float = 180) -> None:
        deadline = time.monotonic() + limit_s  # hang guard only: a loaded 2-core box needs ~15 s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not come up"
            time.sleep(0.1)

    def log_tail(self, size: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-size:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def engine_process(model_dir, *, kv_engine_id: str | None = None, side_channel_port: int | None = None,
                   wait: bool = True, max_model_len: int = 256) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "token_engine.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len), "--block-size", "4",
            "--num-gpu-blocks-override", "128", "--max-num-seqs", "16", "--log-level", "warning"]
    env = {}
    if kv_engine_id is not None:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                                     "engine_id": kv_engine_id})]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port or free_port())
    return Process(argv, port, env, wait)


def gateway_process(model_dir, pools: list[str], *extra: str) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
            "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--log-level", "warning",
            "--engine-block-size", "4", *pools, *extra]
    return Process(argv, port)


def kv_cache_state(engine_url: str) -> dict:
    return httpx.get(engine_url + "/debug/kv_cache", timeout=10).json()


def wait_until_idle(engine_url: str, attempts: int = 400) -> dict:
    """Bounded wait until the engine holds no request; returns its block accounting."""
    state = kv_cache_state(engine_url)
    for _ in range(attempts):
        if state["num_running"] == 0 and state["num_waiting"] == 0 and state["num_free_blocks"] == state["num_blocks"]:
            break
        time.sleep(0.025)
        state = kv_cache_state(engine_url)
    return state


__all__ = ["write_scripted_qwen3", "engine_process", "gateway_process", "Process", "free_port", "torch"]
