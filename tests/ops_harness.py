"""Real server processes for the ops, fault and soak checks, with their logs in files (a pipe nobody reads
would fill and stall a server that logs every request)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.gateway_harness import free_port


class Server:
    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.log_file = open(self.log_path, "wb")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(argv, env=full_env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=self.log_file)

    def wait_healthy(self, limit_s: float = 180) -> Server:
        deadline = time.monotonic() + limit_s  # hang guard only
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}: " + self.log_path.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not come up"
            time.sleep(0.1)

    def log_records(self) -> list[dict]:
        """Every line of the log as JSON (fails on a line that is not one object)."""
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log_file.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()


def start_engine(model_dir, log_dir: Path, name: str, *extra: str, kv_engine_id: str | None = None,
                 blocks: int = 128, max_num_seqs: int = 16, kv_lease_s: float | None = None) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "token_engine.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--block-size", "4",
            "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max_num_seqs),
            "--log-format", "json", *extra]
    env = {}
    if kv_engine_id is not None:
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": kv_engine_id}
        if kv_lease_s is not None:
            kv["kv_connector_extra_config"] = {"kv_lease_duration": kv_lease_s}
        argv += ["--kv-transfer-config", json.dumps(kv)]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    return Server(argv, port, log_dir / f"{name}.log", env)


def start_gateway(model_dir, log_dir: Path, name: str, pools: list[str], *extra: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
            "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--engine-block-size", "4",
            "--log-format", "json", *pools, *extra]
    return Server(argv, port, log_dir / f"{name}.log")


def kv_state(engine_url: str) -> dict:
    return httpx.get(engine_url + "/debug/kv_cache", timeout=30).json()


def wait_idle(engine_url: str, attempts: int = 800) -> dict:
    """Bounded wait until the engine runs nothing and every block is free (leases included)."""
    state = kv_state(engine_url)
    for _ in range(attempts):
        if (state["num_running"] == 0 and state["num_waiting"] == 0 and state["num_held_by_connector"] == 0
                and state["num_free_blocks"] == state["num_blocks"]):
            break
        time.sleep(0.025)
        state = kv_state(engine_url)
    return state
