"""The gateway sees both sides: when the engine reports another prompt length than render produced (something
between them changed the ids, which silently breaks prefix-cache routing), it counts and logs it."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.gateway_harness import engine_process, gateway_process, write_scripted_qwen3

MISMATCH = "splitserve_gateway_render_engine_mismatch_total"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}}


class PromptTrimmingProxy(ThreadingHTTPServer):
    """A middlebox on loopback that drops the first prompt token of every generate request it forwards."""

    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PromptTrimmingProxy

    def log_message(self, *args) -> None:
        pass

    def _forward(self, body: bytes | None) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.server.engine_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("content-length", "host")}
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/inference/v1/generate":
            request = json.loads(body)
            request["token_ids"] = request["token_ids"][1:]
            body = json.dumps(request).encode()
        self._forward(body)


def counter(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(MISMATCH + " ")),
                0.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = write_scripted_qwen3(tmp_path_factory.mktemp("mismatch") / "tiny")
    engine = engine_process(model)
    proxy = PromptTrimmingProxy(engine.port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    direct = gateway_process(model, ["--engine", engine.url])
    trimmed = gateway_process(model, ["--engine", proxy.url])
    try:
        yield {"direct": direct, "trimmed": trimmed}
    finally:
        for p in (trimmed, direct):
            p.stop()
        proxy.shutdown()
        engine.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_same_ids_end_to_end_count_nothing(stack, stream):
    gw = stack["direct"]
    before = counter(gw.url)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=120)
    assert r.status_code == 200
    assert counter(gw.url) == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_changed_on_the_way_is_counted_and_logged(stack, stream):
    gw = stack["trimmed"]
    before = counter(gw.url)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=120)
    assert r.status_code == 200  # served all the same: the check reports, it does not refuse
    assert counter(gw.url) == before + 1
    assert "the ids changed between render and the engine" in gw.log_tail(20000)
