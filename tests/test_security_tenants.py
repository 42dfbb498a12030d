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
