"""``render-service serve`` as real processes: pre-forked workers on one port, metrics summed, clean exit.

One server is started for the module (loading the tokenizer takes seconds); the tests run in file order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest

from tests.render_harness import QWEN3_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def wait_healthy(proc: subprocess.Popen, client: httpx.Client, output: Callable[[], str]) -> None:
    """Until /health answers 200; fails with the server's output if it exits first, or after two minutes."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, output()
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


@contextlib.contextmanager
def two_worker_server_process():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR), "--served-model-name", "qwen3-0.6b",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "2", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_healthy(proc, client, lambda: proc.stdout.read().decode(errors="replace"))
        yield proc, client
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def two_worker_server():
    with two_worker_server_process() as server:
        yield server


def test_workers_serve_one_port_and_share_metrics(two_worker_server):
    proc, client = two_worker_server
    workers = children_of(proc.pid)
    assert len(workers) == 2
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for _ in range(20):
        # a fresh connection each time so the kernel may hand it to either worker
        r = httpx.post(f"{client.base_url}/v1/chat/completions/render", json=body, timeout=30)
        assert r.status_code == 200
        assert r.json()["model"] == "qwen3-0.6b"
    text = client.get("/metrics").text
    line = next(ln for ln in text.splitlines()
                if ln.startswith('splitserve_render_requests_total{endpoint="chat_render",status="200"}'))
    assert float(line.rsplit(" ", 1)[1]) == 20.0  # summed over both workers, whichever answers the scrape


def test_a_dead_worker_is_replaced(two_worker_server):
    proc, client = two_worker_server
    first = children_of(proc.pid)
    os.kill(first[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        now = children_of(proc.pid)
        if len(now) == 2 and first[0] not in now:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert client.post("/v1/completions/render", json={"prompt": "x"}).status_code == 200


def test_sigterm_stops_parent_and_workers():
    with two_worker_server_process() as (proc, _):  # its own server: the shared one serves the other tests
        workers = children_of(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for pid in workers:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def test_bad_flags_fail_fast_with_a_message():
    result = subprocess.run(
        [sys.executable, "-m", "render_service.cli", "serve", "/nonexistent/model", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "tokenizer.json" in result.stderr or "nonexistent" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR), "--default-chat-template-kwargs", "[1]"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "JSON object" in result.stderr


def test_tokenizer_backend_flag_picks_the_encode_path(tmp_path):
    # tiktoken instead of the default fastokens: said in the load line, and the ids are tokenizers' all the same
    from tokenizers import Tokenizer

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR), "--host", "127.0.0.1",
             "--port", str(port), "--tokenizer-backend", "tiktoken"], stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            wait_healthy(proc, client, log.read_text)
            text = "Grüße, 世界! x\u0301 1234567 def f(): return {'a': [1, 2]}"
            got = client.post("/v1/completions/render", json={"model": str(QWEN3_DIR), "prompt": text})
        assert got.status_code == 200, got.text
        reference = Tokenizer.from_file(str(QWEN3_DIR / "tokenizer.json"))
        assert got.json()[0]["token_ids"] == reference.encode(text, add_special_tokens=False).ids
        assert "encode: tiktoken (byte-level BPE proved equal" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    result = subprocess.run([sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_DIR),
                             "--tokenizer-backend", "fastest"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--tokenizer-backend" in result.stderr
