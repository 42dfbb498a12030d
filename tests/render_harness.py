"""Real render servers for tests: uvicorn on a random loopback port, in a background thread.

Loading the Qwen3 tokenizer takes seconds, so each configuration is loaded once per test session and
shared by every test file that asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from render_service.bundle.model_bundle import load_bundle
from render_service.http.server import create_app
from render_service.render.render_config import RenderConfig, build_render_config
from tests.shared_paths import FIXTURES as FIXTURES_DIR

FIXTURES = FIXTURES_DIR
if not FIXTURES.exists():
    FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
QWEN3_DIR = FIXTURES / "qwen3-0.6b"
VLLM_PAIRS = FIXTURES / "vllm-0.32-render"
PARSER_FLAGS = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


@functools.cache
def qwen3_bundle():
    return load_bundle(str(QWEN3_DIR))


@functools.cache
def qwen3_config(parsers: bool = False, max_model_len: int | None = None) -> RenderConfig:
    """The fixture model as the recorded vLLM server served it, sharing one loaded bundle."""
    flags = PARSER_FLAGS if parsers else {}
    bundle = qwen3_bundle()
    if max_model_len is not None:
        bundle = dataclasses.replace(bundle, max_model_len=max_model_len)
    return build_render_config(bundle, served_model_names=["qwen3-0.6b"], **flags)


class RenderServer:
    """A started server; ``client`` is an httpx.Client bound to it. Use as a context manager."""

    def __init__(self, config: RenderConfig, api_key: str | list[str] | None = None, multimodal: Any = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(config, api_key=api_key, multimodal=multimodal)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self) -> RenderServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("render server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@contextlib.contextmanager
def memo_and_plain_servers() -> Iterator[tuple[RenderServer, RenderServer, RenderConfig]]:
    """Two servers of the fixture model with its parsers, one with the message memo and body store as served and
    one without any (``--render-cache-bytes 0``), and the first one's configuration."""
    with_memo = qwen3_config(parsers=True)
    without = build_render_config(qwen3_bundle(), served_model_names=["qwen3-0.6b"], render_cache_bytes=0,
                                  **PARSER_FLAGS)
    assert with_memo.message_memo is not None and with_memo.message_memo.bodies is not None
    assert without.message_memo is None
    with RenderServer(with_memo) as memo_server, RenderServer(without) as plain_server:
        yield memo_server, plain_server, with_memo


def post_both(servers: tuple[RenderServer, RenderServer, RenderConfig], path: str, payload: dict[str, Any]
              ) -> tuple[httpx.Response, httpx.Response]:
    """``payload`` posted to ``path`` of both of ``memo_and_plain_servers``: (with the memo, without)."""
    memo_server, plain_server, _ = servers
    return memo_server.client.post(path, json=payload), plain_server.client.post(path, json=payload)


@contextlib.contextmanager
def image_render_server(bundle_dir: Path, served_name: str, model_id: str, workers: int
                        ) -> Iterator[tuple[RenderServer, Any]]:
    """A render server over a vision bundle with its image pool: (server, pool); the pool's workers end with it."""
    from render_service.multimodal.setup import multimodal_render_for

    config = build_render_config(load_bundle(str(bundle_dir)), served_model_names=[served_name])
    mm = multimodal_render_for(config, model_id=model_id, workers=workers)
    assert mm is not None
    try:
        with RenderServer(config, multimodal=mm) as server:
            yield server, mm
    finally:
        mm.pool.shutdown()


def load_pair(path: Path) -> tuple[dict, dict]:
    """(recorded request, recorded response) for a ``*.request.json`` fixture."""
    response = path.with_name(path.name[: -len("request.json")] + "response.json")
    return json.loads(path.read_text()), json.loads(response.read_text())
