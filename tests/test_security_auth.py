"""Who may call what : API keys on engines, the gateway's engine key on every hop,
the startup warning for a server open beyond loopback, and HTTP connections that may not hold a socket
without sending a request head. Real engine and gateway processes on loopback ports."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from splitserve_common.auth import ApiKeys, api_keys_from, bearer_token, is_loopback, warn_if_open
from tests.gateway_harness import write_scripted_qwen3
from tests.ops_harness import start_engine, start_gateway

KEY = "engine-key-7f3a"
CLIENT_KEY = "client-key-19c2"
GENERATE = {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 2, "temperature": 0}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": False}}
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One keyed engine; a gateway with its key (open on 0.0.0.0 without a client key: it must warn), and a
    gateway without it (with a client key: it must not warn). All with a 1 s header timeout."""
    root = tmp_path_factory.mktemp("security-auth")
    model = write_scripted_qwen3(root / "tiny")
    timeout = ["--http-header-timeout", str(HEADER_TIMEOUT_S)]
    servers = {}
    try:
        servers["engine"] = start_engine(model, root, "engine", "--api-key", KEY, *timeout)
        pools = ["--engine", servers["engine"].url]
        servers["keyed"] = start_gateway(model, root, "keyed", pools, "--engine-api-key", KEY, "--host", "0.0.0.0",
                                         *timeout)
        servers["keyless"] = start_gateway(model, root, "keyless", pools, "--api-key", CLIENT_KEY,
                                           "--host", "0.0.0.0", *timeout)
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def auth(key: str, scheme: str = "Bearer") -> dict[str, str]:
    return {"authorization": f"{scheme} {key}"}


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "UnauthorizedError"
    assert set(error) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/inference/v1/generate", GENERATE),
    ("POST", "/inference/v1/abort_requests", {"request_ids": ["someone-else"]}),
    ("POST", "/abort_requests", {"request_ids": ["someone-else"]}),
    ("GET", "/debug/kv_cache", None),
    ("GET", "/v1/models", None),
    ("GET", "/no/such/path", None),  # unknown paths are guarded too: nothing is open by accident
])
def test_engine_refuses_calls_without_the_key_or_with_a_wrong_one(stack, method, path, body):
    url = stack["engine"].url + path
    for headers in ({}, auth("wrong-key"), auth(KEY, "Basic"), {"authorization": KEY}):
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert_unauthorized(response)
        assert response.headers["www-authenticate"].startswith("Bearer")


def test_engine_takes_its_key_with_the_scheme_in_any_case(stack):
    url = stack["engine"].url + "/inference/v1/generate"
    for scheme in ("Bearer", "bearer", "BEARER"):
        response = httpx.post(url, json=GENERATE, headers=auth(KEY, scheme), timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["token_ids"]) == 2
    assert httpx.get(stack["engine"].url + "/debug/kv_cache", headers=auth(KEY, "bearer"), timeout=30).json()[
        "num_blocks"] > 0


def test_engine_probes_and_scrapes_need_no_key(stack):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(stack["engine"].url + path, timeout=30).status_code == 200, path


# ------------------------------------------------------------------------------------------ gateway


def test_gateway_with_the_engine_key_serves_batch_and_stream(stack):
    url = stack["keyed"].url + "/v1/chat/completions"
    batch = httpx.post(url, json=CHAT, timeout=120)
    assert batch.status_code == 200, batch.text
    assert batch.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=120) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2


def test_gateway_without_the_engine_key_says_so_and_blames_no_client(stack):
    url = stack["keyless"].url + "/v1/chat/completions"
    for body in (CHAT, {**CHAT, "stream": True}):
        response = httpx.post(url, json=body, headers=auth(CLIENT_KEY), timeout=120)
        # not the engine's 401 (the client's own key is fine) and not a 500: the gateway's configuration
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "refused the gateway's credentials" in message and "--engine-api-key" in message


def test_gateway_client_key_scheme_is_case_insensitive(stack):
    url = stack["keyless"].url + "/v1/models"
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers=auth("wrong"), timeout=30).status_code == 401
    assert httpx.get(url, headers=auth(CLIENT_KEY, "bearer"), timeout=30).status_code == 200


def _security_warnings(server) -> list[str]:
    return [r["msg"] for r in server.log_records() if r["level"] == "warning" and r["msg"].startswith("SECURITY")]


def test_a_server_open_beyond_loopback_without_a_key_warns_once_at_startup(stack):
    (line,) = _security_warnings(stack["keyed"])
    assert "0.0.0.0" in line and "without an API key" in line and "--api-key" in line
    assert _security_warnings(stack["keyless"]) == []  # open, but keyed
    assert _security_warnings(stack["engine"]) == []  # keyed (and on loopback)


def test_warn_if_open_covers_every_non_loopback_bind(caplog):
    caplog.set_level(logging.WARNING)
    log = logging.getLogger("test.security")
    assert all(warn_if_open("x", host, ApiKeys(None), log) for host in ("0.0.0.0", "::", "", "10.1.2.3", "engine"))
    assert not any(warn_if_open("x", host, ApiKeys(None), log) for host in ("127.0.0.1", "127.8.0.1", "::1",
                                                                              "[::1]", "localhost"))
    assert not warn_if_open("x", "0.0.0.0", ApiKeys(["k"]), log)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 5
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0")


def test_keys_come_from_the_flag_else_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys_from(None) == ["from-env"]
    assert api_keys_from(["a", "b"]) == ["a", "b"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys_from(None) == []
    keys = ApiKeys(["old", "new"])  # rotation: either key works
    assert keys.accepts("Bearer old") and keys.accepts("bearer new") and not keys.accepts("Bearer older")
    assert bearer_token("Bearer   tok  ") == "tok" and bearer_token("Basic tok") is None and bearer_token("") is None


# ------------------------------------------------------------------------------------- connections


def _closed_within(sock: socket.socket, limit_s: float) -> tuple[bool, bytes, float]:
    """(closed by the server, what it sent, seconds) waiting at most limit_s."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return False, received, time.monotonic() - started
    except ConnectionResetError:
        pass
    return True, received, time.monotonic() - started


@pytest.mark.parametrize("server", ["engine", "keyed"])
def test_half_sent_headers_are_closed_after_the_header_timeout(stack, server):
    port = stack[server].port
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nhost: x\r\ncontent-")
        closed, _, _ = _closed_within(sock, 15)
        assert closed
    # slowloris: a byte every 0.25 s never extends the deadline
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for _ in range(60):
                sock.sendall(b"x")
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - started < 10
        closed, _, _ = _closed_within(sock, 5)
        assert closed


@pytest.mark.parametrize("server", ["engine", "keyed"])
def test_a_connection_that_sends_nothing_is_closed(stack, server):
    with socket.create_connection(("127.0.0.1", stack[server].port)) as sock:
        closed, received, _ = _closed_within(sock, 15)
        assert closed and received == b""


def test_a_stalled_second_request_on_a_keep_alive_connection_is_closed(stack):
    with socket.create_connection(("127.0.0.1", stack["engine"].port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nhost:")
        closed, received, _ = _closed_within(sock, 15)
        assert closed and received == b""


def test_headers_over_the_size_cap_get_431(stack):
    with socket.create_connection(("127.0.0.1", stack["engine"].port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 70_000)
        closed, received, _ = _closed_within(sock, 15)
        assert closed and received.startswith(b"HTTP/1.1 431")


def test_a_header_sent_in_pieces_within_the_timeout_is_served(stack):
    body = json.dumps(GENERATE).encode()
    head = (f"POST /inference/v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"authorization: bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack["engine"].port)) as sock:
        sock.sendall(head[:20])
        time.sleep(HEADER_TIMEOUT_S / 4)
        sock.sendall(head[20:] + body)
        sock.settimeout(60)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_gateway_aborts_carry_the_engine_key(stack, caplog):
    """The abort hop (httpx, not the generate pool) presents the key too; a refused abort is logged."""
    import asyncio

    from render_service.gateway.engine_client import EngineClient

    async def abort(client: EngineClient) -> None:
        try:
            await client.abort(stack["engine"].url, ["nobody"])
        finally:
            await client.aclose()

    caplog.set_level(logging.INFO, logger="render_service.gateway.engine_client")
    asyncio.run(abort(EngineClient(api_key=KEY)))
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    asyncio.run(abort(EngineClient()))
    (refused,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert refused.levelno == logging.WARNING and "401" in refused.getMessage()


def test_the_prefill_hop_carries_the_engine_key(stack):
    """P/D's prefill hop is the plain (non-streaming) generate call: keyed, it is served; unkeyed, it fails as
    a replica failure naming the flag (the flow then tries another replica or answers 503)."""
    import asyncio

    import msgspec

    from render_service.gateway.engine_client import EngineClient, EngineUnavailable

    async def prefill(client: EngineClient):
        try:
            return await client.generate(stack["engine"].url, msgspec.json.encode(GENERATE), "prefill-hop")
        finally:
            await client.aclose()

    assert len(asyncio.run(prefill(EngineClient(api_key=KEY))).choices[0].token_ids) == 2
    with pytest.raises(EngineUnavailable, match="--engine-api-key"):
        asyncio.run(prefill(EngineClient()))


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_the_deadline_holds_on_either_uvicorn_protocol(http):
    """uvicorn falls back to h11 where httptools is missing: the deadline must hold there too."""
    import threading

    import uvicorn

    from splitserve_common.connection_timeouts import header_deadline_protocol

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, http=header_deadline_protocol(0.5, http=http), lifespan="off",
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        try:
            for _ in range(400):
                if server.started:
                    break
                time.sleep(0.025)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # a whole request is served
                sock.settimeout(10)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                sock.sendall(b"GET / HTTP/1.1\r\nho")  # its successor stalls mid-header
                closed, received, _ = _closed_within(sock, 10)
                assert closed and received == b""
        finally:
            server.should_exit = True
            thread.join(30)
