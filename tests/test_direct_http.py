"""The render endpoints answered from the HTTP protocol (render_service/http/direct_http.py) answer as the ASGI path does.

Two real servers on 127.0.0.1, built by the CLI's own ``_uvicorn_server`` in threads of this process (so a test
can read and set the server's lifecycle): one with the direct path, one with ``SPLITSERVE_DIRECT_HTTP=0``. The
same requests go to both over raw sockets, and the answers must match (status, body, the headers that are not
a date), whichever path a request takes: direct (a declared body up to 256 KiB), or the usual one (chunked,
``Expect: 100-continue``, a query string, a larger body, a request pipelined behind another).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from render_service import cli
from render_service.http.direct_http import DIRECT_MAX_BODY, DirectCycle
from render_service.http.server import create_app
from render_service.render.render_config import load_render_config
from tests.gateway_harness import free_port
from tests.shared_paths import QWEN3_FIXTURE_DIR

MODEL = "qwen3"
RENDER = "/v1/chat/completions/render"


class InProcessServer:
    def __init__(self, app, direct: bool, monkeypatch_env) -> None:
        self.port = free_port()
        args = cli.build_parser().parse_args(["serve", str(QWEN3_FIXTURE_DIR), "--host", "127.0.0.1",
                                              "--port", str(self.port), "--disable-uvicorn-access-log"])
        monkeypatch_env(cli.DIRECT_HTTP_ENV, "1" if direct else "0")
        self.server = cli._uvicorn_server(app, args)
        self.server.install_signal_handlers = lambda: None  # (not the main thread)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    @property
    def protocol(self) -> type:
        return self.server.config.http_protocol_class

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers():
    config = load_render_config(str(QWEN3_FIXTURE_DIR), served_model_names=[MODEL], reasoning_parser="qwen3",
                                max_model_len=131072,
                                tool_call_parser="hermes", enable_auto_tool_choice=True)
    app = create_app(config)
    mp = pytest.MonkeyPatch()
    try:
        direct = InProcessServer(app, True, mp.setenv)
        asgi = InProcessServer(app, False, mp.setenv)
    finally:
        mp.undo()
    assert direct.protocol.__name__.startswith("Direct") and not asgi.protocol.__name__.startswith("Direct")
    yield {"direct": direct, "asgi": asgi}
    direct.stop()
    asgi.stop()


def request(path: str, body: bytes, *headers: str, method: str = "POST", content_type: str = "application/json",
            length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"content-type: {content_type}", *headers]
    if length:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(path: str, body: bytes, *headers: str) -> bytes:
    head = request(path, b"", "transfer-encoding: chunked", *headers, length=False)
    half = len(body) // 2
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"


class Reader:
    """HTTP/1.1 responses read off one socket (Content-Length bodies, as the render server writes them)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 20)
        self.buffer += data
        return bool(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), "connection closed before a response"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        size = int(headers["content-length"])
        while len(self.buffer) < size:
            assert self._fill(), "connection closed inside a body"
        body, self.buffer = self.buffer[:size], self.buffer[size:]
        return int(status_line.split()[1]), headers, body

    def closed(self) -> bool:
        self.sock.settimeout(5)
        return not self.buffer and not self._fill()


def exchange(port: int, raw: bytes, responses: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        reader = Reader(sock)
        return [reader.response() for _ in range(responses)]


def comparable(answer: tuple[int, dict[str, str], bytes]) -> tuple[int, dict[str, str], object]:
    """The answer without what two servers answer differently at different moments: the date header, a
    response's ``created`` second."""
    status, headers, body = answer
    try:
        value = json.loads(body)
    except ValueError:
        value = body
    if isinstance(value, dict):
        value.pop("created", None)
    return status, {k: v for k, v in headers.items() if k not in ("date", "content-length")}, value


def chat(content: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}).encode()


BIG = chat("word " * (DIRECT_MAX_BODY // 4))  # past the direct path's body bound: the usual path
CASES = {
    "render": request(RENDER, chat("Hello there"), "x-request-id: case-render"),
    "render_tools": request(RENDER, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "tools": [{"type": "function", "function": {
                                                    "name": "f", "parameters": {"type": "object"}}}]}).encode(),
                            "x-request-id: case-tools"),
    "render_bad_json": request(RENDER, b"{not json", "x-request-id: case-bad"),
    "render_wrong_model": request(RENDER, json.dumps({"model": "other", "messages": []}).encode(),
                                  "x-request-id: case-model"),
    "render_wrong_type": request(RENDER, chat("hi"), "x-request-id: case-type", content_type="text/plain"),
    "completion_render": request("/v1/completions/render", json.dumps({"model": MODEL, "prompt": "Hi"}).encode(),
                                 "x-request-id: case-completion"),
    "tokenize": request("/tokenize", json.dumps({"model": MODEL, "prompt": "Hello world"}).encode(),
                        "x-request-id: case-tokenize"),
    "detokenize": request("/detokenize", json.dumps({"model": MODEL, "tokens": [9707, 1879]}).encode(),
                          "x-request-id: case-detokenize"),
    "derender": request("/v1/chat/completions/derender", json.dumps({
        "model": MODEL, "generate_response": {"request_id": "r1", "choices": [{"token_ids": [9707, 151645]}]},
        "chat_request": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}).encode(),
        "x-request-id: case-derender"),
    "chunked": chunked(RENDER, chat("Sent in chunks"), "x-request-id: case-chunked"),
    "expect_continue": request(RENDER, chat("Expecting"), "x-request-id: case-expect", "expect: 100-continue"),
    "query_string": request(RENDER + "?a=1", chat("With a query"), "x-request-id: case-query"),
    "large_body": request(RENDER, BIG, "x-request-id: case-large"),
    "get_on_render": request(RENDER, b"", "x-request-id: case-get", method="GET"),
}


EXPECTED_STATUS = {"render_bad_json": 400, "render_wrong_model": 404, "render_wrong_type": 400, "get_on_render": 405}


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_paths_answer_alike(servers, case):
    raw = CASES[case]
    if case == "expect_continue":  # the interim 100 first, then the answer (uvicorn's, on both)
        answers = {}
        for name, server in servers.items():
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                head, body = raw.split(b"\r\n\r\n", 1)
                sock.sendall(head + b"\r\n\r\n")
                reader = Reader(sock)
                while b"\r\n\r\n" not in reader.buffer:
                    assert reader._fill()
                assert reader.buffer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
                reader.buffer = reader.buffer[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
                sock.sendall(body)
                answers[name] = reader.response()
    else:
        answers = {name: exchange(server.port, raw)[0] for name, server in servers.items()}
    assert comparable(answers["direct"]) == comparable(answers["asgi"])
    status, headers, _ = answers["direct"]
    assert headers["x-request-id"].startswith("case-") and status == EXPECTED_STATUS.get(case, 200)


def test_keep_alive_and_pipelined_requests_answer_in_order(servers):
    bodies = [chat(f"Message number {i}") for i in range(6)]
    expected = [httpx.post(f"http://127.0.0.1:{servers['asgi'].port}{RENDER}", content=b,
                           headers={"content-type": "application/json", "x-request-id": f"p{i}"}).json()
                for i, b in enumerate(bodies)]
    # all six written at once: the first may go direct, the rest wait behind it (uvicorn's pipeline)
    raw = b"".join(request(RENDER, b, f"x-request-id: p{i}") for i, b in enumerate(bodies))
    answers = exchange(servers["direct"].port, raw, responses=len(bodies))
    assert [json.loads(body) for _, _, body in answers] == expected
    assert [h["x-request-id"] for _, h, _ in answers] == [f"p{i}" for i in range(6)]
    # one after the other on one connection: each goes direct
    with socket.create_connection(("127.0.0.1", servers["direct"].port), timeout=30) as sock:
        reader = Reader(sock)
        for i, b in enumerate(bodies):
            sock.sendall(request(RENDER, b, f"x-request-id: p{i}"))
            status, headers, body = reader.response()
            assert status == 200 and json.loads(body) == expected[i] and "connection" not in headers


def test_a_generated_request_id_is_echoed(servers):
    status, headers, _ = exchange(servers["direct"].port, request(RENDER, chat("no id given")))[0]
    assert status == 200 and len(headers["x-request-id"]) == 32


def test_connection_close_is_honoured(servers):
    with socket.create_connection(("127.0.0.1", servers["direct"].port), timeout=30) as sock:
        sock.sendall(request(RENDER, chat("last one"), "connection: close"))
        reader = Reader(sock)
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == "close"
        assert reader.closed()


def test_a_client_gone_mid_request_leaves_the_server_serving(servers):
    port = servers["direct"].port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        raw = request(RENDER, chat("never read " * 2000))
        sock.sendall(raw[: len(raw) - 10])  # the body never completes
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request(RENDER, chat("abandoned " * 2000)))  # complete, then gone before the answer
    status, _, _ = exchange(port, request(RENDER, chat("still here")))[0]
    assert status == 200


def test_draining_refuses_render_work_and_closes(servers):
    server = servers["direct"]
    lifecycle = server.server.lifecycle
    lifecycle.draining = True
    lifecycle.in_flight += 1  # (as if a request were still running: the server keeps listening meanwhile)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(request(RENDER, chat("too late"), "x-request-id: drain-1"))
            reader = Reader(sock)
            status, headers, body = reader.response()
            assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
            assert headers["x-request-id"] == "drain-1" and json.loads(body)["error"]["code"] == 503
            assert reader.closed()
    finally:
        lifecycle.in_flight -= 1
        lifecycle.draining = False


def test_direct_requests_are_counted_in_flight_and_hand_the_connection_back(servers):
    server = servers["direct"]
    connections = server.server.server_state.connections
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request(RENDER, chat("count me")))
        Reader(sock).response()
        protocol = next(iter(c for c in connections if isinstance(c.cycle, DirectCycle)))
        assert protocol.cycle.response_complete and protocol.timeout_keep_alive_task is not None
    assert server.server.lifecycle.in_flight == 0
