"""The render tier stands alone: ``render-service serve`` on the built-in default bundle, as a real process
in which importing torch (or the engine package) fails, still answers a render."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.gateway_harness import free_port
from tests.ops_harness import Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocking_env(tmp_path) -> dict[str, str]:
    for name in ("torch", "token_engine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: the render tier must not need it')\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}


def test_render_service_serves_the_default_bundle_without_torch(tmp_path):
    env = _blocking_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **env}, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "torch is blocked" in probe.stderr  # the block itself works

    port = free_port()
    server = Server([sys.executable, "-m", "render_service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                     "--log-level", "warning"], port, tmp_path / "render.log", env,
                    cwd=tmp_path)  # not the checkout: `python -m` puts the cwd first on sys.path
    try:
        server.wait_healthy(120)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            reply = client.post("/v1/chat/completions/render",
                                json={"model": model, "messages": [{"role": "user", "content": "Hello"}]})
            assert reply.status_code == 200, reply.text
            text = client.post("/detokenize", json={"model": model, "tokens": reply.json()["token_ids"]}).json()
            assert text["prompt"].startswith("<|im_start|>user\nHello<|im_end|>\n")
    finally:
        server.stop()
