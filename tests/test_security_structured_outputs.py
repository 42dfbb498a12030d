"""Structured-output compile exhaustion and bad JSON bodies, probed as an attacker would: a real
engine server on loopback, the real Qwen3 vocabulary, real xgrammar compiles in real worker processes.

Clients are told apart by their address: every 127.x.y.z is loopback on Linux, so each client binds its
own. The slow spec that passes every bound (eight objects of 250 optional properties: xgrammar takes
seconds per object) stands in for whatever a bound may miss; the compile time limit is 2 s here.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.engine_harness import FIXTURES, ServerThread, engine_config
from tests.gateway_harness import free_port
from tests.ops_harness import Server
from token_engine.models.random_model import write_random_model
from token_engine.structured import GrammarCompiler, GrammarError, parse_structured_outputs
from token_engine.structured.bounds import CompileLimits, check_bounds
from token_engine.structured.pool import PoolLimits

IM_END, END_OF_TEXT = 151645, 151643
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 9104, 30]
ATTACK = {"json": {"type": "string", "pattern": "[a-z]{40000}"}}  # the 60-byte schema
SLOW = {"json": {"type": "object", "properties": {
    f"o{k}": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(250)}} for k in range(8)}}}
NORMAL = {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
          "disable_any_whitespace": True}
COMPILE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("security") / "tiny", arch="qwen3", preset="tiny",
                              overrides={"tie_word_embeddings": False}, tokenizer_dir=FIXTURES / "qwen3-0.6b",
                              dtype="float32")


@pytest.fixture(scope="module")
def grammars(model_dir):
    compiler = GrammarCompiler(model_dir, 151936, [IM_END, END_OF_TEXT], compile_timeout_s=COMPILE_TIMEOUT_S,
                               pool_limits=PoolLimits(workers=2, per_client_pending=2, queue_timeout_s=30.0))
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def server(model_dir, grammars):
    with ServerThread(engine_config(model_dir)) as srv:
        srv.llm.grammars.close()
        srv.llm.grammars = grammars
        yield srv


def client(server, address: str = "127.0.0.1") -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120, transport=httpx.HTTPTransport(local_address=address))


def post(c: httpx.Client, structured) -> httpx.Response:
    return c.post("/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 20,
                                                 "stop_token_ids": [IM_END, END_OF_TEXT],
                                                 "structured_outputs": structured}})


def assert_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert fragment in error["message"], error["message"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # reaped between the signal and the open, or the read
        return False
    return not stat.split(") ", 1)[1].startswith("Z")


def wait_until_dead(pids: list[int], expect: int | None = None) -> list[int]:
    """The pids that died, after a bounded wait for `expect` of them (all when None): a kill takes a moment."""
    expect = len(pids) if expect is None else expect
    for _ in range(400):
        dead = [pid for pid in pids if not alive(pid)]
        if len(dead) >= expect:
            break
        time.sleep(0.025)
    time.sleep(0.1)  # none other follows
    return [pid for pid in pids if not alive(pid)]


# ---- bounds before any compile -------------------------------------------------------------------------

@pytest.mark.parametrize("structured, limit", [
    (ATTACK, "max_repetition"),
    ({"regex": "(a{100}){100}"}, "max_repetition"),
    ({"regex": "((a{10}){10}){11}"}, "max_repetition"),
    ({"regex": "[a-z]{900}" * 20}, "max_repeated_items"),
    ({"grammar": "root ::= [a-z]{40000}"}, "max_repetition"),
    ({"grammar": 'root ::= ("ab" [0-9]{50}){50}'}, "max_repetition"),
    ({"json": {"type": "string", "pattern": "(" * 100 + "a" + ")" * 100}}, "max_nesting_depth"),
    ({"regex": "a|" * 40000 + "b"}, "max_regex_bytes"),
    ({"grammar": 'root ::= "a" # {99999}\n | ("b"{40}){40}'}, "max_repetition"),
    ({"json": {"type": "object", "patternProperties": {"^[a-z]{5000}$": {}}}}, "max_repetition"),
    ({"json": {"type": "object", "properties": {f"p{i}": {} for i in range(300)}}}, "max_properties_per_object"),
    ({"json": {"type": "object", "properties": {f"o{k}": {"type": "object", "properties": {
        f"p{i}": {} for i in range(200)}} for k in range(25)}}}, "max_properties"),
    ({"json": {"enum": list(range(5000))}}, "max_enum_values"),
    ({"choice": [str(i) for i in range(5000)]}, "max_enum_values"),
    ({"json": json.dumps({"type": "string", "description": "x" * (600 << 10)})}, "max_spec_bytes"),
    ({"json": json.loads('{"a":' * 100 + "{}" + "}" * 100)}, "max_nesting_depth"),
    ({"json": '{"a":' * 5000 + "{}" + "}" * 5000}, "max_nesting_depth"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>", "schema": {
        "type": "string", "pattern": "x{2000}"}}], "triggers": ["<a>"]}}, "max_repetition"),
])
def test_specs_over_a_bound_get_a_fast_400_naming_the_limit_without_a_compile(server, grammars, structured, limit):
    with client(server) as c:
        post(c, {"regex": "warm"})  # the vocabulary and the workers are up (first use only)
        pids = grammars.worker_pids()
        started = time.monotonic()
        r = post(c, structured)
        elapsed = time.monotonic() - started
    assert_error(r, 400, limit)
    assert elapsed < 1.5, elapsed  # a hang guard, not a speed claim: the compile would take minutes
    assert grammars.worker_pids() == pids  # no worker was killed, so none was busy with it


@pytest.mark.parametrize("structured", [
    {"regex": "[a-z]{1000}"}, {"regex": r"\{[0-9]{1,3}\}"}, {"regex": "[{]{5}x{,3}"},
    {"grammar": 'root ::= "{100000}" [a-z]{3} # {99999}'}, {"regex": "abc{3}([a-z]{3}-){100}"},
    {"json": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$", "maxLength": 100000}},
    {"choice": ["a"] * 100},
])
def test_specs_within_the_bounds_pass_them(structured):
    check_bounds(parse_structured_outputs(structured), CompileLimits())


# ---- killable compiles, fair caps ------------------------------------------------------------------------

def test_the_slow_compile_is_killed_at_the_limit_and_its_worker_replaced(server, grammars):
    with client(server, "127.0.0.4") as c:
        post(c, {"regex": "warm"})
        before = grammars.worker_pids()
        started = time.monotonic()
        assert_error(post(c, SLOW), 400, f"did not compile within {COMPILE_TIMEOUT_S:g} s")
        assert time.monotonic() - started < COMPILE_TIMEOUT_S + 5  # killed, not left to run for a minute
        killed = wait_until_dead(before[1:], expect=1)
        assert len(killed) == 1  # exactly the worker that ran it
        for _ in range(200):  # its replacement is forked at once
            if len(grammars.worker_pids()) == len(before):
                break
            time.sleep(0.025)
        assert len(grammars.worker_pids()) == len(before) and killed[0] not in grammars.worker_pids()
        again = time.monotonic()
        assert_error(post(c, SLOW), 400, "did not compile within")  # the failure is cached: no second kill
        assert time.monotonic() - again < 1.0
        ok = post(c, {"choice": ["yes", "no"]})
        assert ok.status_code == 200, ok.text


def test_concurrent_slow_compiles_from_one_client_leave_other_clients_served(server, grammars):
    with client(server, "127.0.0.5") as normal:
        cached = post(normal, {"choice": ["cached"]})  # compiled once; later served from the cache
        assert cached.status_code == 200
    slow_specs = [{"json": {**SLOW["json"], "title": f"attack {i}"}} for i in range(3)]  # three distinct specs

    def attack(spec):
        with client(server, "127.0.0.2") as c:
            return post(c, spec)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        attacks = [pool.submit(attack, spec) for spec in slow_specs]
        time.sleep(0.5)  # they are queued or compiling
        with client(server, "127.0.0.3") as other:
            started = time.monotonic()
            r = post(other, NORMAL)
            normal_s = time.monotonic() - started
            assert r.status_code == 200, r.text
            hit = time.monotonic()
            assert post(other, {"choice": ["cached"]}).status_code == 200  # the cache answers without a worker
            hit_s = time.monotonic() - hit
        results = [a.result() for a in attacks]
    # the attacker may hold one worker and queue one more compile (per_client_pending=2): the third is a 429
    statuses = sorted(r.status_code for r in results)
    assert statuses == [400, 400, 429], [r.text for r in results]
    assert_error(next(r for r in results if r.status_code == 429), 429, "per_client_pending_compiles")
    assert all("did not compile within" in r.json()["error"]["message"] for r in results if r.status_code == 400)
    # served while the attacker's compile ran (it never waited for the attacker's 2 s compiles to end)
    assert normal_s < COMPILE_TIMEOUT_S, normal_s
    assert hit_s < COMPILE_TIMEOUT_S, hit_s
    with client(server, "127.0.0.3") as other:  # and after
        assert post(other, {"regex": "(yes|no)"}).status_code == 200


def test_bad_json_bodies_get_the_engines_400_on_every_json_endpoint(server):
    deep_array = b"[" * 100_000 + b"]" * 100_000
    deep_object = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    bodies = [
        deep_array, deep_object,
        b'{"token_ids": [1], "sampling_params": {"structured_outputs": {"json": ' + deep_array + b"}}}",
        b'{"token_ids": [1], "features": ' + deep_object + b"}",
        b'{"request_ids": ' + deep_array + b"}",
        b"", b"{", b'{"token_ids": [1], ', b"\xff\xfe{}", b"[]", b"null", b'"text"', b'{"token_ids": "x"}',
        b'{"token_ids": [1e999]}', b'{"token_ids": [123456789012345678901234567890]}',
    ]
    with client(server) as c:
        for path in ("/inference/v1/generate", "/inference/v1/abort_requests", "/abort_requests"):
            for body in bodies:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body[:40], r.status_code, r.text[:200])
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
                assert error["type"] == "BadRequestError"
        assert post(c, {"choice": ["still serving"]}).status_code == 200


def test_closing_the_compiler_leaves_no_process_or_thread(model_dir):
    threads_before = set(threading.enumerate())  # the module's own compiler has its threads
    compiler = GrammarCompiler(model_dir, 151936, [IM_END, END_OF_TEXT], compile_timeout_s=COMPILE_TIMEOUT_S)
    compiler.compile(parse_structured_outputs({"regex": "[0-9]{2}"}))
    for _ in range(400):  # the second worker may still be forking
        if len(pids := compiler.worker_pids()) == 3:
            break
        time.sleep(0.025)
    assert len(pids) == 3  # the zygote and two workers
    outcome = {}

    def wait_for_the_slow_compile():
        try:
            compiler.compile(parse_structured_outputs(SLOW))
        except GrammarError as exc:
            outcome["status"] = exc.status

    waiting = threading.Thread(target=wait_for_the_slow_compile)
    waiting.start()
    time.sleep(0.3)  # compiling
    compiler.close()
    waiting.join(5)
    assert not waiting.is_alive() and outcome == {"status": 503}  # ended at once instead of running on
    assert not [t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith(("grammar-", "structured-"))]
    assert wait_until_dead(pids) == pids
    with pytest.raises(GrammarError) as exc:
        compiler.compile(parse_structured_outputs({"regex": "[0-9]{3}"}))
    assert exc.value.status == 503


@pytest.mark.slow  # a real engine process, its vocabulary and its compile workers
def test_sigterm_during_a_compile_stops_the_engine_promptly(model_dir, tmp_path):
    port = free_port()
    engine = Server([sys.executable, "-m", "token_engine.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                     "--port", str(port), "--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
                     "--num-gpu-blocks-override", "64", "--structured-outputs-compile-timeout", "30"],
                    port, tmp_path / "engine.log")
    try:
        engine.wait_healthy()
        with httpx.Client(base_url=engine.url, timeout=300) as c:
            assert post(c, {"regex": "warm"}).status_code == 200
        for _ in range(400):  # the second worker may still be forking
            if len(children := _descendants(engine.proc.pid)) == 3:
                break
            time.sleep(0.025)
        assert len(children) == 3, children  # the zygote and two workers

        def slow():
            with httpx.Client(base_url=engine.url, timeout=120) as c:
                try:
                    return post(c, SLOW).status_code
                except httpx.TransportError:
                    return None

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(slow)
            time.sleep(1.0)  # compiling now, for up to 30 s
            started = time.monotonic()
            engine.proc.send_signal(signal.SIGTERM)
            engine.proc.wait(40)
            stopped_s = time.monotonic() - started
            assert pending.result(30) in (503, None)  # the compile was stopped, not waited for
        assert engine.proc.returncode == 0
        assert stopped_s < 20, (stopped_s, engine.log_path.read_text()[-3000:])
        assert wait_until_dead(children) == children
    finally:
        engine.kill()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            kids = [int(k) for k in (task / "children").read_text().split()]
            out += kids
            todo += kids
    return out
