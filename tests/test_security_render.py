"""The render tier's untrusted inputs, probed as an attacker would: real
render server processes on loopback with the real Qwen3 tokenizer, and one in-thread server whose memory
is traced.

- Trusted chat templates (``--trust-request-chat-template``): nested loops hung a worker, ``'x'.center(n)``
  allocated before any cap, MemoryError and deep nesting were 500s. Now every loop iteration and call
  checks the render's deadline, amplifying operations are sized first, and all of it is a 400; the server
  stays healthy.
- Streaming derender memory: each stream's pipeline was kept with a copy of its tools (10 streams with 7 MB
  of tools kept 333 MB). Now what is kept is bounded in bytes, and large configurations are not kept.
- ``stream_state`` was unsigned unless a secret was configured: any client could hand-craft parser state.
  Now a server without a secret signs with its own, and says at startup that replicas need a shared one.
- Request ids on the render endpoints: refused or replaced as in the gateway (tests/test_security_gateway.py).
"""

from __future__ import annotations

import contextlib
import gc
import re
import resource
import sys
import tracemalloc

import httpx
import pytest

from tests.derender_http import MODEL, config
from tests.gateway_harness import free_port
from tests.ops_harness import Server
from tests.render_harness import RenderServer
from tests.shared_paths import QWEN3_FIXTURE_DIR

pytestmark = pytest.mark.slow  # two server processes and a 1 s deadline per runaway template: 15-25 s

TEMPLATE_TIMEOUT_S = 1.0
HANG_GUARD_S = 60  # only stops a broken server from hanging the test; no assertion depends on time
MESSAGES = [{"role": "user", "content": "hi"}]
PARSERS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def render_server(log_dir, name: str, *flags: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "render_service.cli", "serve", str(QWEN3_FIXTURE_DIR), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", MODEL, "--log-format", "json", *PARSERS, *flags]
    return Server(argv, port, log_dir / f"{name}.log", env={"SPLITSERVE_STREAM_STATE_SECRET": ""})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two replicas without a stream_state secret; the first trusts request templates (1 s per render)."""
    root = tmp_path_factory.mktemp("security-render")
    started = {}
    try:
        started["trusting"] = render_server(root, "trusting", "--trust-request-chat-template",
                                            "--chat-template-timeout", str(TEMPLATE_TIMEOUT_S))
        started["other"] = render_server(root, "other")
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def render(server: Server, template: str | None = None, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    if template is not None:
        body["chat_template"] = template
    return httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=HANG_GUARD_S)


def assert_still_serving(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=HANG_GUARD_S).status_code == 200
    r = render(server, "{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% endfor %}")
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"]


# ------------------------------------------------------------------------------ trusted chat templates

@contextlib.contextmanager
def address_space_limit(server: Server, headroom_mb: int):
    """The server may map at most ``headroom_mb`` more than it holds now, while the block runs: an allocation
    beyond that fails inside the server (MemoryError) instead of taking the machine's memory."""
    pid = server.proc.pid
    with open(f"/proc/{pid}/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    soft, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, ((vm_kb << 10) + (headroom_mb << 20), hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))


TIME = "time limit"
SIZE = "too large"
# name: (template, what the 400 says). Size attacks must be refused before they allocate (a 1 GB address
# space limit is set meanwhile: on main they were a MemoryError, a 500); time attacks hung the worker.
RUNAWAY_TEMPLATES = {
    "nested-loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TIME),
    "exponential-macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                          "{{ f(60) }}", TIME),
    "shared-structure": ("{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}"
                         "{% endfor %}{{ ns.a | tojson }}", (TIME, SIZE)),
    "center": ("{{ 'x'.center(3000000000) }}", SIZE),
    "format-width": ("{{ '{:>3000000000}'.format(1) }}", SIZE),
    "percent-width": ("{{ '%3000000000d' % 1 }}", SIZE),
    "doubling-concat": ("{% set ns = namespace(s='x' * 1000000) %}{% for i in range(14) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}", SIZE),
    "printed-references": ("{% set s = 'x' * 10000000 %}{{ [s] * 1000 }}", SIZE),
    "indent": ("{{ ('a\n' * 1000000) | indent(3000) }}", SIZE),
    "batch-fill": ("{{ [1] | batch(1000000000, 0) | list | length }}", SIZE),
    "deep-expression": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),
    "deep-blocks": ("{% if x %}" * 200 + "y" + "{% endif %}" * 200, "nested too deeply"),
    "oversized-source": ("{# " + "x" * 300_000 + " #}", "longer than"),
}


@pytest.mark.parametrize("name", list(RUNAWAY_TEMPLATES))
def test_runaway_request_templates_are_a_400_and_the_server_keeps_serving(servers, name):
    trusting = servers["trusting"]
    template, says = RUNAWAY_TEMPLATES[name]
    with address_space_limit(trusting, 1024):
        r = render(trusting, template)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] in ("chat_template", "messages")
    assert any(fragment in error["message"] for fragment in ((says,) if isinstance(says, str) else says)), error
    assert_still_serving(trusting)


def test_a_template_whose_allocations_fail_is_a_400_not_a_500(servers):
    """Two 240 MB strings (60M four-byte characters, within the size bounds) against an address-space limit
    256 MB above what the server holds now: the second allocation fails, the render answers 400, and the
    server lives on."""
    trusting = servers["trusting"]
    with address_space_limit(trusting, 256):
        r = render(trusting, "{% set a = '\U0001F600' * 60000000 %}{% set b = a ~ '!' %}{{ b | length }}")
    assert r.status_code == 400, r.text[:300]
    assert "memory" in r.json()["error"]["message"]
    assert_still_serving(trusting)


def test_render_request_ids_are_refused_or_replaced_as_in_the_gateway(servers):
    trusting = servers["trusting"]
    for bad in ("a\r\nx-injected: 1", "x" * 70_000):
        r = render(trusting, request_id=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text[:300]
    r = httpx.post(trusting.url + "/v1/chat/completions/render", json={"model": MODEL, "messages": MESSAGES},
                   headers=[(b"x-request-id", "caf\u00e9".encode())], timeout=HANG_GUARD_S)
    # the header is not echoed: the id is a fresh one of the server's own shape
    assert r.status_code == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{16}", r.json()["request_id"]), r.text[:300]


# ---------------------------------------------------------------------------------------- stream_state


def derender_chunk(server: Server, state=None) -> httpx.Response:
    body = {"model": MODEL, "stream": True, "stream_state": state, "prompt_token_ids": [151644, 77091, 198],
            "chat_request": {"messages": MESSAGES},
            "generate_chunk": {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": [9707]}]}}
    return httpx.post(server.url + "/v1/chat/completions/derender", json=body, timeout=HANG_GUARD_S)


def test_stream_state_is_signed_without_a_configured_secret(servers):
    trusting, other = servers["trusting"], servers["other"]
    first = derender_chunk(trusting)
    assert first.status_code == 200, first.text
    state = first.json()["stream_state"]
    token = state["splitserve_state"]
    assert len(token.split(".")) == 3  # ss1.<payload>.<signature>
    assert derender_chunk(trusting, state).status_code == 200  # its own state continues
    unsigned = {**state, "splitserve_state": ".".join(token.split(".")[:2])}
    r = derender_chunk(trusting, unsigned)  # a client-made state: refused
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_state", r.text
    r = derender_chunk(other, state)  # another replica without a shared secret cannot check it
    assert r.status_code == 400 and "signature" in r.json()["error"]["message"], r.text
    for server in (trusting, other):
        warnings = [rec["msg"] for rec in server.log_records() if rec["level"] == "warning"]
        assert any("stream_state" in w and "--stream-state-secret" in w for w in warnings), warnings


# ------------------------------------------------------------------------------ streaming derender memory


def test_streaming_derender_keeps_no_copy_of_each_streams_tools():
    """Eight streams with 1 MB of tools each: on main every stream's pipeline stayed cached with its tools
    (about 3x their size each); now nothing of them stays once the calls are answered."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * 400,
        "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 60}
                                                        for j in range(20)}}}} for i in range(600)]
    chat_request = {"messages": MESSAGES, "tools": tools}
    with RenderServer(config(reasoning_parser="qwen3", tool_call_parser="hermes",
                             enable_auto_tool_choice=True)) as srv:

        def chunk(stream: int) -> None:
            r = srv.client.post("/v1/chat/completions/derender", json={
                "model": MODEL, "stream": True, "chat_request": chat_request, "prompt_token_ids": [151644, 198],
                "generate_chunk": {"request_id": f"stream-{stream}", "choices": [{"index": 0, "token_ids": [9707]}]}})
            assert r.status_code == 200, r.text[:300]

        chunk(-1)  # warm: first-use caches of the server and the client
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for stream in range(8):
                chunk(stream)
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    tools_bytes = len(httpx.Request("POST", "/", json=tools).content)
    assert tools_bytes > 1_000_000
    assert kept < tools_bytes, f"{kept} bytes kept after 8 streams of {tools_bytes} bytes of tools"
