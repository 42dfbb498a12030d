"""Many clients behind one gateway, probed as one of them would attack the others: a real engine server (with an
API key, its structured-output compiles in real worker processes over the real Qwen3 vocabulary) behind a real
gateway process on loopback that takes two client keys, one per tenant.

- fairness reaches the engine: one tenant's slow schemas, sent through the gateway, leave the other tenant's
  structured outputs served (the engine used to count the whole gateway as one client);
- stored responses belong to the tenant that created them: ids are the server's, a client's ``request_id`` or
  ``X-Request-Id`` cannot name (and overwrite) another tenant's response, and GET, DELETE and
  ``previous_response_id`` do not find another tenant's;
- what a response stores is bounded: over-size ``metadata``, ``user`` and ``reasoning`` are a 400, a tenant's
  stored bytes are bounded and its oldest go first, other tenants' stay.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from splitserve_common.auth import AUTHENTICATED_SCOPE_KEY, ApiKeys
from splitserve_common.tenants import TENANT_HEADER, TenantResolver, engine_caller
from tests.engine_harness import ServerThread, engine_config
from tests.gateway_harness import gateway_process, write_scripted_qwen3
from token_engine.structured import GrammarCompiler
from token_engine.structured.pool import PoolLimits

IM_END, END_OF_TEXT = 151645, 151643
ENGINE_KEY = "engine-key-0123456789"
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
COMPILE_TIMEOUT_S = 2.0
TENANT_BYTES = 30_000
# Passes every bound and takes xgrammar seconds per object: stands in for whatever a bound may miss.
SLOW_SCHEMA = {"type": "object", "properties": {
    f"o{k}": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(250)}} for k in range(8)}}
NORMAL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_scripted_qwen3(tmp_path_factory.mktemp("tenants") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    compiler = GrammarCompiler(model_dir, 151936, [IM_END, END_OF_TEXT], compile_timeout_s=COMPILE_TIMEOUT_S,
                               pool_limits=PoolLimits(workers=2, per_client_pending=2, queue_timeout_s=60.0))
    with ServerThread(engine_config(model_dir, max_model_len=256), api_keys=ApiKeys(ENGINE_KEY)) as srv:
        srv.llm.grammars.close()
        srv.llm.grammars = compiler
        yield srv
    compiler.close()


@pytest.fixture(scope="module")
def gateway(model_dir, engine, tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    proc = gateway_process(model_dir, ["--engine", engine.url], "--api-key", ALICE, BOB, "--engine-api-key",
                           ENGINE_KEY, "--responses-store-path", str(store),
                           "--responses-store-tenant-bytes", str(TENANT_BYTES), "--log-level", "info")
    yield proc
    proc.stop()


def client(gateway, key: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def chat_with_schema(c: httpx.Client, schema: dict, name: str = "s") -> httpx.Response:
    return c.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "answer"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}})


def respond(c: httpx.Client, **fields) -> httpx.Response:
    return c.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 6, **fields})


# ---- identity ------------------------------------------------------------------------------------------

def test_the_tenant_is_what_the_gateway_vouches_for():
    resolver = TenantResolver(ApiKeys([ALICE, BOB]))
    alice = resolver.tenant({"authorization": f"Bearer {ALICE}"}, "10.0.0.1")
    assert alice == resolver.tenant({"authorization": f"bearer {ALICE}"}, "10.0.0.2")  # the key, not the peer
    assert alice != resolver.tenant({"authorization": f"Bearer {BOB}"}, "10.0.0.1")
    assert ALICE not in alice and TENANT_HEADER not in alice
    # a client's own claim is nobody's business: the gateway never reads the engine's header from a client
    assert resolver.tenant({"authorization": f"Bearer {ALICE}", TENANT_HEADER: "bob"}, "10.0.0.1") == alice
    proxied = TenantResolver(ApiKeys([ALICE]), "X-Tenant")
    assert proxied.tenant({"authorization": f"Bearer {ALICE}", "x-tenant": "acme"}, "p") != \
        proxied.tenant({"authorization": f"Bearer {ALICE}", "x-tenant": "globex"}, "p")
    with pytest.raises(ValueError):
        TenantResolver(ApiKeys(None), "X-Tenant")  # a header is believed only from an authenticated caller
    assert TenantResolver(ApiKeys(None)).tenant({}, "10.0.0.9") == "addr-10.0.0.9"
    # the engine believes the header only from a caller that presented its key
    assert engine_caller({}, {TENANT_HEADER: "key-abc"}, "10.0.0.1") == "10.0.0.1"
    assert engine_caller({AUTHENTICATED_SCOPE_KEY: True}, {TENANT_HEADER: "key-abc"}, "10.0.0.1") == "tenant:key-abc"
    assert engine_caller({AUTHENTICATED_SCOPE_KEY: True}, {TENANT_HEADER: "a\r\nb"}, "10.0.0.1") == "10.0.0.1"


# ---- fairness reaches the engine -----------------------------------------------------------------------

def test_one_tenants_slow_schemas_leave_the_others_structured_outputs_served(gateway):
    """Alice sends three distinct slow schemas through the gateway (one over her pending cap of two); Bob's
    schema is compiled on the worker she may not take, and he is answered. Before, the engine counted the
    gateway as one client: Bob's request was Alice's third, refused."""
    slow = [{**SLOW_SCHEMA, "title": f"attack {i}"} for i in range(3)]

    def attack(schema):
        with client(gateway, ALICE) as c:
            return chat_with_schema(c, schema)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        attacks = [pool.submit(attack, schema) for schema in slow]
        time.sleep(1.0)  # they are queued or compiling (ordering only: Bob's result is asserted, not its time)
        with client(gateway, BOB) as bob:
            r = chat_with_schema(bob, NORMAL_SCHEMA)
            bob_done_first = not all(a.done() for a in attacks)
            again = chat_with_schema(bob, NORMAL_SCHEMA)  # the same schema: compiled once, from the cache
        results = [a.result() for a in attacks]
    assert r.status_code == 200, r.text
    assert again.status_code == 200, again.text
    assert bob_done_first  # he did not wait for her compiles to end
    statuses = sorted(x.status_code for x in results)
    assert statuses == [400, 400, 429], [x.text for x in results]  # her own cap, passed on as her 429
    with client(gateway, BOB) as bob:  # and no replica was put in cooldown by her 429
        assert chat_with_schema(bob, {"type": "object", "properties": {"n": {"type": "integer"}}}).status_code == 200


# ---- stored responses have owners ----------------------------------------------------------------------

def test_stored_responses_belong_to_the_tenant_that_created_them(gateway):
    with client(gateway, ALICE) as alice, client(gateway, BOB) as bob:
        mine = respond(alice, metadata={"who": "alice"})
        assert mine.status_code == 200, mine.text
        rid = mine.json()["id"]
        assert rid.startswith("resp_")
        # Bob names Alice's id in both places a client may name its request: the server mints his id anyway
        hijack = bob.post("/v1/responses", headers={"X-Request-Id": rid},
                          json={"model": "tiny", "input": "overwrite", "max_output_tokens": 6, "request_id": rid,
                                "metadata": {"who": "bob"}})
        assert hijack.status_code == 200, hijack.text
        assert hijack.json()["id"] != rid
        named = respond(alice, request_id="my-own-id")
        assert named.status_code == 200 and named.json()["id"] != "my-own-id"
        got = alice.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["metadata"] == {"who": "alice"}  # not overwritten
        # invisible to Bob: GET, DELETE and previous_response_id all say not found
        assert bob.get(f"/v1/responses/{rid}").status_code == 404
        assert bob.delete(f"/v1/responses/{rid}").status_code == 404
        follow = respond(bob, previous_response_id=rid)
        assert follow.status_code == 400 and follow.json()["error"]["code"] == "previous_response_not_found"
        assert respond(alice, previous_response_id=rid).status_code == 200  # Alice continues her own
        assert alice.delete(f"/v1/responses/{rid}").status_code == 200
        assert alice.get(f"/v1/responses/{rid}").status_code == 404
        quiet = named.json()["id"]  # an id no client sent as its own request id
        assert alice.get(f"/v1/responses/{quiet}").status_code == 200
        assert respond(alice, previous_response_id=quiet).status_code == 200
    log = gateway.log_tail(1 << 20)
    assert f"/v1/responses/{quiet[:12]}" in log and quiet not in log  # ids are not logged in full


# ---- what a response stores is bounded -----------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"user": "u" * 100_000}, "user"),
    ({"reasoning": {"effort": "low", "summary": "s" * 100_000}}, "reasoning"),
    ({"reasoning": {"effort": {"nested": ["x"] * 1000}}}, "reasoning"),
])
def test_over_size_stored_fields_are_a_400_naming_the_field(gateway, fields, param):
    with client(gateway, ALICE) as alice:
        r = respond(alice, **fields)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_stored_bytes_are_bounded_per_tenant_and_the_oldest_go_first(gateway):
    with client(gateway, ALICE) as alice, client(gateway, BOB) as bob:
        too_big = respond(alice, input="x " * TENANT_BYTES)
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "store"
        kept = respond(bob, input="bob's")
        assert kept.status_code == 200
        ids = []
        full = {f"key{k}": "v" * 512 for k in range(16)}  # the most metadata a response may carry: ~8.5 KB
        for i in range(6):  # ~9 KB stored each: three fit in the tenant's bytes
            r = respond(alice, input=f"turn {i}", metadata=full)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        present = [alice.get(f"/v1/responses/{i}").status_code == 200 for i in ids]
        assert present[-1] and not present[0]  # the newest stay, the oldest went
        assert bob.get(f"/v1/responses/{kept.json()['id']}").status_code == 200  # Alice's bytes evict only hers


# ---- every API renders on the render queue -------------------------------------------------------------

def render_work_counts(c: httpx.Client) -> dict[str, float]:
    counts = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("splitserve_render_work_seconds_count{"):
            endpoint = line.split('endpoint="', 1)[1].split('"', 1)[0]
            counts[endpoint] = float(line.rsplit(" ", 1)[1])
    return counts


def test_messages_responses_and_count_tokens_render_on_the_render_queue(gateway):
    """Bodies of 256 KiB and more render on the queue's bulk thread, never on the event loop: each API's work
    is counted by the queue (it used to be counted for chat and completions only)."""
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "z" * 100}
            for i in range(3001)]  # ~400 KB
    with client(gateway, ALICE) as c:
        before = render_work_counts(c)
        calls = [("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": many}, "messages"),
                 ("/v1/messages/count_tokens", {"model": "tiny", "messages": many}, "count_tokens"),
                 ("/v1/messages/render", {"model": "tiny", "max_tokens": 4, "messages": many}, "messages_render"),
                 ("/v1/responses", {"model": "tiny", "input": many, "store": False}, "responses"),
                 ("/v1/responses/render", {"model": "tiny", "input": many}, "responses_render")]
        for path, body, _ in calls:
            r = c.post(path, json=body)
            assert r.status_code in (200, 400), r.text  # 400: longer than the tiny model's context
            assert c.get("/health").status_code == 200
        after = render_work_counts(c)
    for _, _, endpoint in calls:
        assert after.get(endpoint, 0) > before.get(endpoint, 0), (endpoint, after)


# ---- smaller ones ---------------------------------------------------------------------------------------

def test_a_vllm_shaped_plain_stream_state_keeps_the_bounds_of_a_signed_one(gateway):
    """vLLM's plain-path window carries no signature: on completions it is adopted only within the bounds our
    own signed state keeps (4096 pending bytes), never as 256 KB of parser state."""
    with client(gateway, ALICE) as c:
        def chunk(state):
            return c.post("/v1/completions/derender", json={
                "model": "tiny", "stream": True, "stream_state": state, "prompt_token_ids": [9707],
                "generate_chunk": {"request_id": "g", "choices": [{"index": 0, "token_ids": [1879]}]}})
        ok = chunk({"prev_tokens": ["Hello"], "prefix_offset": 0, "read_offset": 0, "role_sent": True})
        assert ok.status_code == 200, ok.text
        big = chunk({"prev_tokens": ["\u0100" * 256] * 1024, "prefix_offset": 0, "read_offset": 0,
                     "role_sent": True})
        assert big.status_code == 400 and big.json()["error"]["param"] == "stream_state", big.text


def test_the_literal_templated_path_is_a_404_not_a_500(gateway):
    with client(gateway, ALICE) as c:
        for method in ("GET", "DELETE"):
            r = c.request(method, "/v1/responses/{response_id}")
            assert r.status_code == 404, r.text


def test_request_heads_over_64_kib_get_431_even_when_they_arrive_in_one_read(gateway):
    import socket

    for size, expected in ((60_000, b" 200 "), (70_000, b" 431 "), (320_000, b" 431 ")):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
            assert expected in s.recv(64), size


def test_a_reader_that_stopped_reading_has_its_request_aborted(engine, monkeypatch):
    """The engine's per-request output queue is bounded: past the bound, the request is aborted and the queue
    ends with its error (the engine thread delivers updates as it does for every request)."""
    import asyncio
    import threading

    from token_engine.core.engine import RequestUpdate, SequenceDelta
    from token_engine.http import protocol as p
    from token_engine.http import server as engine_server

    monkeypatch.setattr(engine_server, "MAX_PENDING_UPDATES", 8)
    state = engine.app.state.server

    async def probe() -> tuple[int, str | None, bool]:
        req = p.GenerateRequest(token_ids=[1, 2, 3], sampling_params=p.SamplingParams(max_tokens=100))
        gen = engine_server.Generation(state, req, "slow-reader", 1)
        feeder = threading.Thread(target=lambda: [gen.on_update(RequestUpdate(
            gen.engine_id, [SequenceDelta(0, [5], [], None)])) for _ in range(50)])
        feeder.start()
        feeder.join()
        for _ in range(100):
            await asyncio.sleep(0)
        items = [gen.queue.get_nowait() for _ in range(gen.queue.qsize())]
        gen.finish()
        return len(items), items[-1].error, gen.done

    size, error, done = asyncio.run(probe())
    assert size == 8 and done
    assert error == engine_server.SLOW_READER
