"""Graceful shutdown with real processes: on SIGTERM a server keeps its in-flight streams going to the
end, refuses new work with an OpenAI-style 503, answers /health with 503 (readiness drops), then exits 0.

A request whose body is still being uploaded is in flight as far as the server is concerned; the tests
hold one such request open across the SIGTERM (released by the test), so that the server cannot have
finished its work before the probes run, whatever the machine's speed. It is in flight only once a server
process has accepted its connection and read its head: before that it waits in the listening socket's queue,
and a SIGTERM then finds every worker idle. The tests read the kernel's socket table to know.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.gateway_harness import (
    LOOP_START,
    engine_process,
    gateway_process,
    wait_until_idle,
    write_scripted_qwen3,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_scripted_qwen3(tmp_path_factory.mktemp("ops-shutdown") / "tiny")


def _loopback_sockets(port: int) -> list[tuple[int, int]]:
    """(state, unread bytes) of each IPv4 socket on 127.0.0.1:``port``; for a listening socket the second field
    is the number of connections waiting to be accepted."""
    local = f"0100007F:{port:04X}"
    rows = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[1] == local:
                rows.append((int(fields[3], 16), int(fields[4].split(":")[1], 16)))
    return rows


_TCP_ESTABLISHED, _TCP_LISTEN = 0x01, 0x0A


def wait_until_server_read_everything(port: int, timeout: float = 60.0) -> None:
    """Until no connection to ``port`` waits to be accepted and none holds bytes its server has not read."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _loopback_sockets(port)
        listening = [queued for state, queued in rows if state == _TCP_LISTEN]
        unread = [n for state, n in rows if state == _TCP_ESTABLISHED]
        if listening and not any(listening) and not any(unread):
            return
        assert time.monotonic() < deadline, f"port {port}: a connection is still unaccepted or unread: {rows}"
        time.sleep(0.01)


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")


class HeldRequest:
    """A POST whose body is sent in two parts; the second only after release(). Runs in a thread. Returns once a
    server process has read the first part (then parsing it takes the server one event-loop turn)."""

    def __init__(self, url: str, body: bytes, port: int):
        self.url = url
        self.head, self.tail = body[: len(body) // 2], body[len(body) // 2:]
        self.released = threading.Event()
        self.head_sent = threading.Event()
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.head_sent.wait(60)
        wait_until_server_read_everything(port)
        time.sleep(0.2)  # the read head becomes a request on the server's next event-loop turn

    def _body(self):
        yield self.head
        self.head_sent.set()
        self.released.wait(120)
        yield self.tail

    def _run(self) -> None:
        try:
            self.response = httpx.post(self.url, content=self._body(), timeout=120,
                                       headers={"content-type": "application/json", "x-request-id": "held-1"})
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> httpx.Response:
        self.released.set()
        self.thread.join(120)
        assert self.error is None, self.error
        assert self.response is not None
        return self.response


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def assert_draining(url: str, work_path: str, work_body: dict) -> None:
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 503
    refused = httpx.post(url + work_path, json=work_body, timeout=30)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert set(error) == {"message", "type", "param", "code"}


def test_gateway_sigterm_finishes_streams_refuses_new_work_and_exits_0(model):
    engine = engine_process(model)
    gateway = gateway_process(model, ["--engine", engine.url, "--workers", "2", "--shutdown-grace-seconds", "60"])
    try:
        held_body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 8, "temperature": 0}
        held = HeldRequest(gateway.url + "/v1/completions", httpx.Request("POST", "/", json=held_body).content,
                           gateway.port)
        stream_body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 120, "temperature": 0,
                       "stream": True, "ignore_eos": True, "return_token_ids": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", gateway.url + "/v1/completions",
                                                            json=stream_body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            gateway.proc.send_signal(signal.SIGTERM)
            assert_draining(gateway.url, "/v1/completions", held_body)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert first.startswith("data: {")
        # every token of the stream arrived (counted by id: a gateway that fell behind joins events into one chunk)
        ids = sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in [first[6:], *rest[:-1]])
        assert rest[-1] == "[DONE]" and ids == 120
        assert all("error" not in event for event in rest)
        done = held.result()
        assert done.status_code == 200
        assert done.json()["usage"]["completion_tokens"] == 8
        assert done.headers["x-request-id"] == "held-1"
        assert gateway.proc.wait(60) == 0, gateway.log_tail()
        # The engine behind it is untouched and holds no blocks.
        assert httpx.get(engine.url + "/health", timeout=30).status_code == 200
        state = wait_until_idle(engine.url)
        assert state["num_free_blocks"] == state["num_blocks"]
    finally:
        gateway.stop()
        engine.stop()


def test_prefork_gateway_answers_every_probe_while_its_workers_exit(model):
    """Pre-forked workers share one listening socket, and an idle worker exits first: a probe it had accepted
    just before must still get its 503, not a closed connection."""
    engine = engine_process(model)
    gateway = gateway_process(model, ["--engine", engine.url, "--workers", "2", "--shutdown-grace-seconds", "60"])
    try:
        held_body = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 4, "temperature": 0}
        held = HeldRequest(gateway.url + "/v1/completions", httpx.Request("POST", "/", json=held_body).content,
                           gateway.port)
        gateway.proc.send_signal(signal.SIGTERM)
        statuses = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            statuses.append(httpx.get(gateway.url + "/health", timeout=30).status_code)
        assert statuses and set(statuses) == {503}
        assert held.result().status_code == 200
        assert gateway.proc.wait(60) == 0, gateway.log_tail()
    finally:
        gateway.stop()
        engine.stop()


def test_engine_sigterm_finishes_streams_refuses_new_work_and_exits_0(model):
    engine = engine_process(model)
    try:
        held_body = {"token_ids": [LOOP_START], "sampling_params": {"max_tokens": 5, "temperature": 0}}
        held = HeldRequest(engine.url + "/inference/v1/generate", httpx.Request("POST", "/", json=held_body).content,
                           engine.port)
        stream_body = {"token_ids": [LOOP_START], "stream": True,
                       "sampling_params": {"max_tokens": 100, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(timeout=120) as http, http.stream("POST", engine.url + "/inference/v1/generate",
                                                            json=stream_body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            engine.proc.send_signal(signal.SIGTERM)
            assert_draining(engine.url, "/inference/v1/generate", held_body)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        tokens = sum(len(c["token_ids"]) for e in rest[:-1] for c in json.loads(e)["choices"])
        assert tokens == 99  # the first event carried one token
        done = held.result()
        assert done.status_code == 200
        assert len(done.json()["choices"][0]["token_ids"]) == 5
        assert engine.proc.wait(60) == 0, engine.log_tail()
    finally:
        engine.stop()

