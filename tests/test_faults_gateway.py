"""Injected faults on a real CPU stack (two prefill engines, one decode engine over NIXL, a gateway with two
worker processes): a render replica, a prefill engine and a decode engine are killed (SIGKILL) mid-stream.

Each time the gateway either completes the request or ends it with a clear error, the engines that are
left stay healthy, and no KV block leaks (every block free, no lease held). One stack, one test: each phase
kills one more process and the decode engine goes last, so the phases run in that order whatever order a
runner gives the tests.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil
import pytest

from tests.gateway_harness import LOOP_START, write_scripted_qwen3
from tests.ops_harness import start_engine, start_gateway, wait_idle

MAX_TOKENS = 240  # the model's context is 256: a stream of a few hundred decode steps
STREAM = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
          "ignore_eos": True, "return_token_ids": True}
SHORT = {"model": "tiny", "prompt": [LOOP_START], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = write_scripted_qwen3(root / "tiny")
    servers = {}
    try:
        for name in ("prefill_a", "prefill_b", "decode"):
            # A short lease: a prefill whose decode peer died gives its blocks back sooner.
            servers[name] = start_engine(model, root, name, kv_engine_id=f"faults-{name}", kv_lease_s=10)
        for s in list(servers.values()):
            s.wait_healthy()
        servers["gateway"] = start_gateway(
            model, root, "gateway", ["--prefill", servers["prefill_a"].url, servers["prefill_b"].url,
                                     "--decode", servers["decode"].url],
            "--workers", "2", "--prefix-affinity-blocks", "0")
        servers["gateway"].wait_healthy()
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def data_events(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def tokens_in(events: list[str]) -> int:
    # Token ids, not chunks: a gateway that fell behind sends what one engine read brought in as one chunk.
    return sum(len(c["token_ids"] or []) for e in events if e != "[DONE]" and "error" not in json.loads(e)
               for c in json.loads(e)["choices"])


def assert_engine_idle(url: str) -> None:
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    state = wait_idle(url)
    assert state["num_running"] == 0 and state["num_held_by_connector"] == 0
    assert state["num_free_blocks"] == state["num_blocks"], state


def stream_killing_after_four_lines(gateway_url: str, engine) -> list[str]:
    """The data events of one streamed completion whose ``engine`` is killed after the first four lines."""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", gateway_url + "/v1/completions", json=STREAM) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            head = data_events(next(lines) for _ in range(4))
            engine.kill()
            return head + data_events(lines)


def worker_serving(gateway_pid: int, client_port: int) -> int:
    """The gateway worker process that holds the connection from our local port."""
    for child in psutil.Process(gateway_pid).children():
        for conn in child.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == client_port:
                return child.pid
    raise AssertionError("no gateway worker holds the connection")


def killed_render_replica_drops_its_stream_and_frees_the_engine_request(stack):
    gateway = stack["gateway"]
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", gateway.url + "/v1/completions", json=STREAM) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert len(data_events(next(lines) for _ in range(6))) >= 1
            client_port = r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
            victim = worker_serving(gateway.proc.pid, client_port)
            psutil.Process(victim).send_signal(signal.SIGKILL)
            with pytest.raises(httpx.TransportError):  # the connection drops: no hang, no silent truncation
                for _ in lines:
                    pass
    # The engine saw its client go and aborted the request: nothing running, no block held.
    assert_engine_idle(stack["decode"].url)
    # The parent replaced the worker; the gateway keeps serving.
    for _ in range(4):
        assert httpx.post(gateway.url + "/v1/completions", json=SHORT, timeout=120).status_code == 200
    for _ in range(400):  # bounded: a worker that died young is replaced after a one-second pause
        if len(psutil.Process(gateway.proc.pid).children()) == 2:
            break
        time.sleep(0.025)
    assert len(psutil.Process(gateway.proc.pid).children()) == 2


def killed_prefill_engine_mid_stream_lets_the_stream_complete_and_new_requests_fail_over(stack):
    gateway = stack["gateway"]
    # decode already holds the KV when prefill dies: it needs prefill no longer
    events = stream_killing_after_four_lines(gateway.url, stack["prefill_a"])
    assert events[-1] == "[DONE]"
    assert tokens_in(events) == MAX_TOKENS and not any('"error"' in e for e in events)
    # New requests: the dead replica fails before its first token and the gateway retries the other one.
    for _ in range(4):
        r = httpx.post(gateway.url + "/v1/completions", json=SHORT, timeout=120)
        assert r.status_code == 200, r.text
    assert_engine_idle(stack["prefill_b"].url)
    assert_engine_idle(stack["decode"].url)


def killed_decode_engine_mid_stream_ends_the_stream_with_a_clear_error(stack):
    gateway = stack["gateway"]
    events = stream_killing_after_four_lines(gateway.url, stack["decode"])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 502
    assert tokens_in(events) < MAX_TOKENS
    # No decode replica left: a new request is a clear 5xx error, not a hang or a bare 500.
    r = httpx.post(gateway.url + "/v1/completions", json=SHORT, timeout=120)
    assert r.status_code in (502, 503)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # The surviving prefill engine holds no lease for the dead decode engine once its leases expired.
    assert_engine_idle(stack["prefill_b"].url)
    assert httpx.get(gateway.url + "/health", timeout=30).status_code == 200


def test_a_render_replica_then_a_prefill_then_the_decode_engine_killed_mid_stream(stack):
    killed_render_replica_drops_its_stream_and_frees_the_engine_request(stack)
    killed_prefill_engine_mid_stream_lets_the_stream_complete_and_new_requests_fail_over(stack)
    killed_decode_engine_mid_stream_ends_the_stream_with_a_clear_error(stack)
