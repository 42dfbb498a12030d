"""The render tier stands alone: ``render-service serve`` on the built-in default bundle, as a real process
in which importing torch (or the engine package) fails, still answers a render."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocking_env(tmp_path) -> dict[str, str]:
    for name in ("torch", "token_engine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the render tier must not need it')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}


def test_render_service_serves_the_default_bundle_without_torch(tmp_path):
    env = _blocking_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr  # the block itself works

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "render_service.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "render-service did not come up"
                time.sleep(0.1)
            model = client.get("/v1/models").json()["data"][0]["id"]
            reply = client.post("/v1/chat/completions/render",
                                json={"model": model, "messages": [{"role": "user", "content": "Hello"}]})
            assert reply.status_code == 200, reply.text
            token_ids = reply.json()["token_ids"]
            text = client.post("/detokenize", json={"model": model, "tokens": token_ids}).json()["prompt"]
            assert text.startswith("<|im_start|>user\nHello<|im_end|>\n")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
