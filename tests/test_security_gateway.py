"""What a client of the gateway sends that ends up in engine requests , probed as an
attacker would: real engine processes (a P/D pair with NIXL between them), a P/D gateway and a collocated
gateway, all on loopback.

- Request ids: a client's id reaches engine ``X-Request-Id`` headers. A CR/LF in it injected a header of
  the client's choosing, a character outside latin-1 was a 500, a 70 KB id passed. Now a body id that is too
  long or holds control characters is a 400, any other id reaches engines only when header-safe (a digest
  stands in for the rest), and an unsafe ``X-Request-Id`` header is ignored.
- ``n`` in P/D: each choice is its own prefill and decode call, so no engine saw ``n`` and ``n=500`` became
  1000 engine calls. Now P/D refuses ``n`` above the engines' max_num_seqs before any engine call, as a
  collocated engine does.

Every test ends with both engines' KV blocks and leases back to idle. Starting two engines and two gateways
takes most of this module's time (about a minute on a loaded 2-core box).
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from splitserve_common.request_ids import engine_header_id, header_safe
from tests.gateway_harness import write_scripted_qwen3
from tests.ops_harness import start_engine, start_gateway, wait_idle

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 16  # the engines' --max-num-seqs (ops_harness), given to the P/D gateway
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("security-gateway")
    model = write_scripted_qwen3(root / "tiny")
    servers = {}
    try:
        servers["prefill"] = start_engine(model, root, "prefill", kv_engine_id="sec-prefill")
        servers["decode"] = start_engine(model, root, "decode", kv_engine_id="sec-decode")
        for name in ("prefill", "decode"):
            servers[name].wait_healthy()
        servers["pd"] = start_gateway(model, root, "pd", ["--prefill", servers["prefill"].url, "--decode",
                                                          servers["decode"].url],
                                      "--engine-max-num-seqs", str(MAX_NUM_SEQS))
        servers["collocated"] = start_gateway(model, root, "collocated", ["--engine", servers["decode"].url])
        for name in ("pd", "collocated"):
            servers[name].wait_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def assert_engines_idle(stack) -> None:
    for name in ("prefill", "decode"):
        state = wait_idle(stack[name].url)
        assert state["num_running"] == 0 and state["num_held_by_connector"] == 0, (name, state)
        assert state["num_free_blocks"] == state["num_blocks"], (name, state)


def chat(stack, gateway: str, stream: bool, body: dict | None = None,
         headers: dict | list | None = None) -> tuple[int, list[dict]]:
    """(status, the JSON objects answered: the body, or every SSE event)."""
    payload = {**CHAT, **(body or {}), "stream": stream}
    with httpx.Client(base_url=stack[gateway].url, timeout=120) as client:
        response = client.post("/v1/chat/completions", json=payload, headers=headers)
    if not stream or response.status_code != 200:
        return response.status_code, [response.json()]
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return response.status_code, events


def wait_for_log_lines(stack, prefix: str, count: int) -> None:
    """Bounded wait until the engines logged ``count`` generate calls whose id starts with ``prefix`` (a line
    is written once its response is done, after the client may have read it)."""
    for _ in range(400):
        if sum(rid.startswith(prefix) for rid in engine_generate_ids(stack)) >= count:
            return
        time.sleep(0.025)
    raise AssertionError(f"no engine logged {count} generate calls under {prefix}*: {engine_generate_ids(stack)}")


def engine_generate_ids(stack) -> list[str]:
    """The request ids the engines' access logs carry for generate calls (from the X-Request-Id they got)."""
    return [r["request_id"] for name in ("prefill", "decode") for r in stack[name].log_records()
            if r["logger"] == "splitserve.access" and r.get("path") == "/inference/v1/generate"]


@pytest.mark.parametrize("gateway", ["pd", "collocated"])
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_request_ids_never_reach_an_engine_header_unless_header_safe(stack, gateway, stream):
    for bad in ("a\r\nx-injected: 1", "ok\nnext", "tab\there", "x" * 70_000):
        status, [answer] = chat(stack, gateway, stream, {"request_id": bad})
        assert status == 400, answer
        assert answer["error"]["param"] == "request_id" and answer["error"]["type"] == "BadRequestError"
    # vLLM echoes any printable id in the response: so do we, and the engines get a digest of it
    status, answers = chat(stack, gateway, stream, {"request_id": "résumé-中文 1"})
    assert status == 200, answers
    assert {a["id"] for a in answers} == {"chatcmpl-résumé-中文 1"}
    digest = engine_header_id("chatcmpl-résumé-中文 1")
    assert re.fullmatch(r"id-[0-9a-f]{32}", digest)
    wait_for_log_lines(stack, digest + "-", 2 if gateway == "pd" else 1)
    # an X-Request-Id header that could not be echoed is ignored, as the access log ignores it
    for header in ("caf\u00e9".encode(), b"x" * 7000, b"two words"):
        status, answers = chat(stack, gateway, stream, headers=[(b"x-request-id", header)])
        assert status == 200, answers
        assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{16}", a["id"]) for a in answers), answers[0]["id"]
    # a safe id travels as it is (engine logs stay correlated with the client's)
    safe = f"trace-{gateway}-{int(stream)}"
    status, _ = chat(stack, gateway, stream, {"request_id": safe})
    assert status == 200
    wait_for_log_lines(stack, f"chatcmpl-{safe}-", 2 if gateway == "pd" else 1)
    assert all(header_safe(rid) for rid in engine_generate_ids(stack))
    for name in ("prefill", "decode"):
        assert "x-injected" not in stack[name].log_path.read_text()
    assert_engines_idle(stack)


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
def test_pd_bounds_n_as_a_collocated_engine_does_before_any_engine_call(stack, stream):
    for n in (500, MAX_NUM_SEQS + 1):
        status, [pd] = chat(stack, "pd", stream, {"n": n, "request_id": f"pd-n-{n}-{stream}"})
        assert status == 400, pd
        status, [collocated] = chat(stack, "collocated", stream, {"n": n, "request_id": f"co-n-{n}-{stream}"})
        assert status == 400, collocated
        assert pd["error"]["message"] == collocated["error"]["message"] == \
            f"n must be between 1 and max_num_seqs ({MAX_NUM_SEQS}), got {n}."
        assert pd["error"]["param"] == "n"
    # the collocated refusals cost one engine call each; the P/D ones none at all (n=500 was 1000 calls)
    wait_for_log_lines(stack, f"chatcmpl-co-n-500-{stream}-", 1)
    wait_for_log_lines(stack, f"chatcmpl-co-n-{MAX_NUM_SEQS + 1}-{stream}-", 1)
    assert not [rid for rid in engine_generate_ids(stack) if rid.startswith("chatcmpl-pd-n-")]
    status, answers = chat(stack, "pd", stream, {"n": 2})
    assert status == 200, answers
    assert {c["index"] for a in answers for c in a["choices"]} == {0, 1}
    assert_engines_idle(stack)


@pytest.mark.parametrize("gateway", ["pd", "collocated"])
def test_responses_and_messages_apply_the_same_request_id_rules(stack, gateway):
    url = stack[gateway].url
    bodies = {"/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
              "/v1/messages": {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}}
    for path, body in bodies.items():
        for bad in ("a\r\nx-injected: 1", "x" * 70_000):
            r = httpx.post(url + path, json={**body, "request_id": bad}, timeout=120)
            assert r.status_code == 400, r.text[:300]
        r = httpx.post(url + path, json={**body, "request_id": "résumé 中文"}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        if path == "/v1/responses":  # a stored response's id is the server's; the client's names the engine hops
            assert r.json()["id"].startswith("resp_")
        else:
            assert r.json()["id"] == "résumé 中文"
    wait_for_log_lines(stack, engine_header_id("résumé 中文") + "-", 2 * (2 if gateway == "pd" else 1))
    for name in ("prefill", "decode"):
        assert "x-injected" not in stack[name].log_path.read_text()
    assert all(header_safe(rid) for rid in engine_generate_ids(stack))
    assert_engines_idle(stack)
