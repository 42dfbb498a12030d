"""Probes of the P/D KV handoff's trust boundary (docs/security.md "KV handoff"), tried as an
attacker on the network would: a real prefill engine process (`token_engine.cli serve`, NIXL between the
processes) and real decode engines over HTTP in this process, a shared side-channel secret, loopback
addresses only. Every attack ends with both engines' KV blocks and leases back to idle."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest
import torch

from tests.engine_harness import EngineProcess, ServerThread, engine_config, free_port, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.kv_connector import side_channel

SECRET = "probe-secret-0123456789abcdef"
GREEDY = {"temperature": 0.0, "max_tokens": 6}
BLOCKS = 64  # prefill pool, 4-token blocks: a caller may hold a quarter (16 blocks) under leases
HANG_GUARD_S = 60  # only stops a broken test from hanging; no assertion depends on time


def prompt(seed: int, n: int = 28) -> list[int]:
    return [1000 + (seed * 7919 + 37 * i) % 140000 for i in range(n)]


def kv_config(engine_id: str, **extra) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra}


class PrefillProcess(EngineProcess):
    """The producer whose KV and leases the attacks aim at; it knows the side-channel secret."""

    def __init__(self, model_dir):
        self.side_port = free_port()
        super().__init__(model_dir, kv_config("prefill-probe"), self.side_port, {"SPLITSERVE_KV_SECRET": SECRET},
                         blocks=BLOCKS)

    def prefill(self, tokens: list[int], rid: str, client: httpx.Client | None = None) -> httpx.Response:
        return (client or self.client).post("/inference/v1/generate", headers={"X-Request-Id": rid}, json={
            "token_ids": tokens, "sampling_params": {"temperature": 0.0, "max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True}})

    def params(self, tokens: list[int], rid: str) -> dict:
        r = self.prefill(tokens, rid)
        assert r.status_code == 200, r.text
        return r.json()["kv_transfer_params"]

    def abort(self, *rids: str) -> None:
        assert self.client.post("/inference/v1/abort_requests", json={"request_ids": list(rids)}).status_code == 200

    def kv(self) -> dict:
        return self.client.get("/debug/kv_cache").json()



@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("sec") / "tiny")
    prefill = PrefillProcess(model_dir)
    decode_cfg = engine_config(model_dir, kv_transfer_config=kv_config(
        "decode-probe", kv_side_channel_secret=SECRET, kv_allowed_peers="127.0.0.1/32"))
    wrong_cfg = engine_config(model_dir, kv_transfer_config=kv_config(
        "decode-wrong-secret", kv_side_channel_secret="not-the-secret-at-all"))
    reference = LLMEngine(engine_config(model_dir))  # collocated, never exposed to an attack
    try:
        with ServerThread(decode_cfg) as decode, ServerThread(wrong_cfg) as wrong:
            yield {"prefill": prefill, "decode": decode, "wrong": wrong, "reference": reference}
    finally:
        prefill.kill()
        mp.undo()
        torch.set_num_threads(threads)


def generate(server: ServerThread, tokens: list[int], params: dict | None = None) -> httpx.Response:
    with server.client() as c:
        return c.post("/inference/v1/generate", json={
            "token_ids": tokens, "sampling_params": GREEDY, **({"kv_transfer_params": params} if params else {})})


def expected(stack, tokens: list[int]) -> list[int]:
    return stack["reference"].generate([tokens], SamplingOptions(**GREEDY))[0]


def assert_idle(stack) -> None:
    """Both sides back to every block free and nothing held for a peer (bounded wait, never a sleep)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        p = stack["prefill"].kv()
        d = [s.llm for s in (stack["decode"], stack["wrong"])]
        if p["num_free_blocks"] == p["num_blocks"] and p["num_held_by_connector"] == 0 and all(
                e.num_free_blocks() == e.num_blocks and not e.requests for e in d):
            return
        assert time.monotonic() < deadline, f"not idle: prefill {p}"
        time.sleep(0.05)


# ---- 1. KV read and prefix-cache poisoning through kv_transfer_params ------------------------------------

def test_foreign_block_ids_under_a_lease_of_ones_own_are_refused_and_poison_nothing(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    victim, mine = prompt(1), prompt(2)
    victim_params = prefill.params(victim, "victim")
    my_params = prefill.params(mine, "attacker")
    assert victim_params["remote_block_ids"] != my_params["remote_block_ids"]
    # my lease, my prompt, the victim's block ids: decode would compute on the victim's KV
    forged = {**my_params, "remote_block_ids": victim_params["remote_block_ids"]}
    r = generate(decode, mine, forged)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("KV handoff refused") and error["type"] == "BadRequestError"
    # the refusal consumed nothing: the real owners still get their KV, and decode's prefix cache was not
    # poisoned under my prompt's hashes (a plain request for it computes the collocated answer)
    r = generate(decode, mine, my_params)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected(stack, mine)
    r = generate(decode, victim, victim_params)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected(stack, victim)
    assert generate(decode, mine).json()["choices"][0]["token_ids"] == expected(stack, mine)
    assert_idle(stack)


@pytest.mark.parametrize("mutate", [
    lambda q, other: q.pop("remote_token_hash"),                                      # the hash is mandatory
    lambda q, other: q.update(remote_token_hash="0" * 32),                            # not this prompt's
    lambda q, other: q.update(remote_block_ids=q["remote_block_ids"][:-1] + [other["remote_block_ids"][-1]]),
    lambda q, other: q.update(remote_block_ids=list(reversed(q["remote_block_ids"]))),
], ids=["no-hash", "wrong-hash", "one-foreign-block", "reordered-blocks"])
def test_any_claim_that_is_not_exactly_the_lease_is_a_400(stack, mutate):
    prefill, decode = stack["prefill"], stack["decode"]
    mine, other = prompt(3), prompt(4)
    params, other_params = prefill.params(mine, "claim"), prefill.params(other, "claim-other")
    forged = dict(params)
    mutate(forged, other_params)
    r = generate(decode, mine, forged)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("KV handoff refused")
    prefill.abort("claim", "claim-other")
    assert_idle(stack)


def test_the_producer_refuses_a_claim_on_its_side_channel(stack):
    """Decode is the one being attacked, so prefill is the authority: asked over its (authenticated) side
    channel to vouch for and pin a lease with other blocks or another token hash, it answers "refused" and
    pins nothing, so the lease's real reader still gets it afterwards."""
    prefill = stack["prefill"]
    tokens = prompt(5)
    params = prefill.params(tokens, "sidechannel-claim")
    _, _, link = side_channel.open_link("127.0.0.1", prefill.side_port, secret=SECRET.encode())
    try:
        rid, epoch, blocks = params["remote_request_id"], params["remote_lease_epoch"], params["remote_block_ids"]
        claims = [(blocks[:-1] + [BLOCKS - 1], params["remote_token_hash"]), (blocks, "f" * 32), (blocks, ""),
                  (None, params["remote_token_hash"]), (blocks[1:], params["remote_token_hash"])]
        for claimed, claimed_hash in claims:
            link.ask(rid, epoch, "probe-reader", 5.0, claimed, claimed_hash)
        answers = []
        deadline = time.monotonic() + HANG_GUARD_S
        while len(answers) < len(claims):
            assert time.monotonic() < deadline
            answers += link.answers()
        assert [(a.status, a.pinned_s) for a in answers] == [("refused", 0.0)] * len(claims)
    finally:
        link.close()
    r = generate(stack["decode"], tokens, params)  # not pinned to the prober: decode reads it
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected(stack, tokens)
    assert_idle(stack)


# ---- 2. side channel authentication ------------------------------------------------------------------

def test_side_channel_peers_without_the_secret_are_dropped_before_anything_is_served(stack):
    port = stack["prefill"].side_port
    for secret in (None, b"wrong-secret-wrong-secret"):
        with pytest.raises(side_channel.SideChannelError):
            side_channel.fetch_publication("127.0.0.1", port, secret=secret)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # a plain publication request
        payload = b'{"op":"publication"}'
        raw.sendall(len(payload).to_bytes(4, "big") + payload)
        assert raw.recv(65536) == b""  # closed, nothing served
    pub, _ = side_channel.fetch_publication("127.0.0.1", port, secret=SECRET.encode())
    assert pub.engine_id == "prefill-probe"


def test_a_client_with_a_secret_refuses_a_server_that_cannot_prove_it():
    server = side_channel.SideChannelServer(_publication())  # no secret: could be anyone's listener
    impostor = side_channel.SideChannelServer(_publication(), secret=b"another-secret-0123")
    try:
        for s in (server, impostor):
            with pytest.raises(side_channel.SideChannelError):
                side_channel.fetch_publication("127.0.0.1", s.port, secret=SECRET.encode())
    finally:
        server.close()
        impostor.close()


def test_decode_with_another_secret_fails_the_handoff_generically(stack):
    prefill = stack["prefill"]
    tokens = prompt(6)
    params = prefill.params(tokens, "wrong-secret")
    r = generate(stack["wrong"], tokens, params)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == f"KV handoff failed: side_channel: {side_channel.UNREACHABLE}"
    assert r.json()["error"]["type"] == "BadGatewayError"  # the peer failed, not this engine
    prefill.abort("wrong-secret")
    assert_idle(stack)


def test_a_side_channel_beyond_loopback_without_a_secret_warns_loudly(caplog):
    from token_engine.kv_connector.nixl import warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="token_engine.kv_transfer"):
        assert warn_if_exposed("0.0.0.0", 5600, None)
        assert not warn_if_exposed("127.0.0.1", 5600, None)
        assert not warn_if_exposed("localhost", 5600, None)
        assert not warn_if_exposed("0.0.0.0", 5600, SECRET.encode())
    [record] = [r for r in caplog.records if "SECURITY" in r.getMessage()]
    assert "WITHOUT a secret" in record.getMessage() and "0.0.0.0:5600" in record.getMessage()


# ---- 3. SSRF from decode -----------------------------------------------------------------------------

def _listener(host: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def test_decode_never_contacts_a_peer_outside_its_allowlist(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    tokens = prompt(7)
    params = prefill.params(tokens, "ssrf")
    bait = _listener("127.0.0.2")  # loopback, but not in decode's --kv-allowed-peers 127.0.0.1/32
    try:
        for host in ("127.0.0.2", "::ffff:127.0.0.2"):
            r = generate(decode, tokens, {**params, "remote_host": host, "remote_port": bait.getsockname()[1]})
            assert r.status_code == 400, r.text
            assert "not an allowed KV peer" in r.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            bait.accept()  # not one connection attempt reached it
    finally:
        bait.close()
    prefill.abort("ssrf")
    assert_idle(stack)


def test_the_error_text_never_tells_an_open_port_from_a_closed_one(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    tokens = prompt(8)
    params = prefill.params(tokens, "scan")
    closed = free_port()
    opened = _listener("127.0.0.1")
    opened.setblocking(True)

    def answer_garbage():  # an allowed host's other service: accepts, says something, hangs up
        for _ in range(2):
            try:
                conn, _ = opened.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=answer_garbage, daemon=True)
    t.start()
    try:
        texts = []
        for port in (closed, opened.getsockname()[1]):
            r = generate(decode, tokens, {**params, "remote_port": port})
            assert r.status_code == 502, r.text
            texts.append(r.json()["error"]["message"])
        assert texts[0] == texts[1] == f"KV handoff failed: side_channel: {side_channel.UNREACHABLE}"
    finally:
        opened.close()
        t.join(5)
    prefill.abort("scan")
    assert_idle(stack)


# ---- 4. resource holding -----------------------------------------------------------------------------

def test_one_caller_cannot_hold_most_of_the_prefill_kv_under_leases(stack):
    """Eight prefill calls for a remote decode that never comes: on main they held 7 blocks each, 56 of
    64, for the whole lease. Now a caller holds at most its quarter; its other prefills wait in the queue
    holding no KV (a busy gateway is slowed, never refused), another caller (another address) is not
    affected, and the waiting ones run once the caller's leases end."""
    from concurrent.futures import ThreadPoolExecutor, wait

    prefill = stack["prefill"]
    rids = [f"hog-{i}" for i in range(8)]
    with ThreadPoolExecutor(len(rids)) as pool:
        clients = [httpx.Client(base_url=prefill.client.base_url, timeout=HANG_GUARD_S) for _ in rids]
        try:
            futures = {pool.submit(prefill.prefill, prompt(20 + i), rid, c): rid
                       for i, (rid, c) in enumerate(zip(rids, clients))}
            deadline = time.monotonic() + HANG_GUARD_S
            while sum(f.done() for f in futures) < 2:
                assert time.monotonic() < deadline, "no prefill finished"
                time.sleep(0.02)
            other = httpx.Client(base_url=prefill.client.base_url, timeout=HANG_GUARD_S,
                                 transport=httpx.HTTPTransport(local_address="127.0.0.2"))
            with other:
                r = prefill.prefill(prompt(30), "other-caller", other)
            assert r.status_code == 200, r.text
            # the other caller's prefill ran while the hog's six stayed queued, holding nothing
            granted = [rid for f, rid in futures.items() if f.done()]
            assert len(granted) == 2, granted
            assert all(f.result().status_code == 200 for f in futures if f.done())
            kv = prefill.kv()
            assert kv["num_blocks"] - kv["num_free_blocks"] <= BLOCKS // 4 + 7  # the hog's quarter + other's 7
            prefill.abort("other-caller")
            released: set[str] = set()
            while len(released) < len(rids):  # release what finished (decode read it, as it were): more start
                pending = [f for f, rid in futures.items() if rid not in released]
                done, _ = wait(pending, timeout=HANG_GUARD_S, return_when="FIRST_COMPLETED")
                assert all(f.result().status_code == 200 for f in done)
                finished = {futures[f] for f in done}
                assert finished, "a queued prefill never started"
                prefill.abort(*finished)
                released |= finished
        finally:
            for c in clients:
                c.close()
    prefill.abort(*rids)
    assert_idle(stack)


def test_aborting_a_finished_prefill_releases_its_lease_at_once(stack):
    """A decode hop that failed (decode down) need not keep prefill's blocks for the 30 s lease: the caller
    aborts the prefill request by id, as it aborts a running one, and the blocks come back now."""
    prefill = stack["prefill"]
    tokens = prompt(9)
    params = prefill.params(tokens, "orphan")
    assert prefill.kv()["num_held_by_connector"] == 1
    prefill.abort("orphan")
    kv = prefill.kv()
    deadline = time.monotonic() + 5  # far inside the 30 s lease: only the abort can free it this soon
    while kv["num_held_by_connector"] and time.monotonic() < deadline:
        time.sleep(0.02)
        kv = prefill.kv()
    assert kv["num_held_by_connector"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
    r = generate(stack["decode"], tokens, params)  # the released lease cannot be read afterwards
    assert r.status_code == 502 and "stale" in r.json()["error"]["message"]
    assert_idle(stack)


def test_idle_side_channel_connections_cannot_lock_new_peers_out(stack):
    """300 connections that never authenticate: on main the 256 allowed ones locked every new peer out
    for 600 s. Now the stalest are closed to make room, so an engine peer gets in at once, and a full
    P/D handoff still works while they are open."""
    prefill, decode = stack["prefill"], stack["decode"]
    hogs = [socket.create_connection(("127.0.0.1", prefill.side_port), timeout=10) for _ in range(300)]
    try:
        pub, _ = side_channel.fetch_publication("127.0.0.1", prefill.side_port, secret=SECRET.encode())
        assert pub.engine_id == "prefill-probe"
        tokens = prompt(10)
        r = generate(decode, tokens, prefill.params(tokens, "after-flood"))
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected(stack, tokens)
    finally:
        for s in hogs:
            s.close()
    assert_idle(stack)


def test_a_connection_that_never_authenticates_is_closed_soon(monkeypatch):
    monkeypatch.setattr(side_channel, "HANDSHAKE_TIMEOUT_S", 0.3)
    server = side_channel.SideChannelServer(_publication(), secret=SECRET.encode())
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as idle:
            assert idle.recv(1) == b""  # the server hung up (main kept it open for 600 s)
        deadline = time.monotonic() + HANG_GUARD_S
        while server.connection_count():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        server.close()


@pytest.mark.parametrize("secret", [SECRET.encode(), None], ids=["handshake", "first-request"])
def test_a_frame_dribbled_a_byte_at_a_time_is_cut_off(monkeypatch, secret):
    """A socket timeout bounds one recv: on main a peer sending a byte every 0.2 s kept its half-sent frame
    (and the connection, busy, so never evicted) as long as it liked. Now a frame has a deadline as a whole
    (2 s here, a tenth of what the dribble takes): the server hangs up before the frame is complete, and
    serves nothing."""
    monkeypatch.setattr(side_channel, "HANDSHAKE_TIMEOUT_S", 2.0)
    monkeypatch.setattr(side_channel, "SOCKET_TIMEOUT_S", 2.0)
    server = side_channel.SideChannelServer(_publication(), secret=secret)
    op = {"op": "auth", "nonce": "ab" * side_channel.NONCE_BYTES} if secret else {"op": "publication"}
    payload = json.dumps(op).encode()
    frame = len(payload).to_bytes(4, "big") + payload
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as sock:
            sent, closed = 0, False
            while sent < len(frame) and not closed:
                try:
                    sock.sendall(frame[sent:sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                sent += 1
                time.sleep(0.2)
                if select.select([sock], [], [], 0)[0]:
                    try:
                        closed = sock.recv(65536) == b""  # an answer would be data: nothing is served
                    except ConnectionResetError:
                        closed = True
                    assert closed, "the server answered a dribbled frame"
            assert closed and sent < len(frame), f"{sent} of {len(frame)} bytes went through"
    finally:
        server.close()


def _publication() -> side_channel.AgentPublication:
    return side_channel.AgentPublication(
        engine_id="probe", agent_name="probe", agent_metadata=b"\x01" * 64, incarnation=1,
        base_addr=0x7F0000000000, mem_type="DRAM", device_id=0,
        geometry=side_channel.WireGeometry(64, 2, 16, 2, 16, "bfloat16"))



def test_cli_flags_and_variables_reach_the_connector(tmp_path):
    from token_engine.cli import build_parser, engine_config_from_args
    from token_engine.kv_connector.config import parse_nixl_config

    argv = ["serve", str(tmp_path), "--kv-transfer-config", json.dumps(kv_config("cli")),
            "--kv-side-channel-secret", SECRET, "--kv-allowed-peers", "10.0.0.0/8, prefill.svc.cluster.local"]
    cfg = parse_nixl_config(engine_config_from_args(build_parser().parse_args(argv)).kv_transfer_config, env={})
    assert cfg.side_channel_secret == SECRET.encode()
    assert cfg.allowed_peers == ("10.0.0.0/8", "prefill.svc.cluster.local")
    assert SECRET not in repr(cfg)  # never in a log line that prints the config
    env_cfg = parse_nixl_config(kv_config("env"), env={"SPLITSERVE_KV_SECRET": SECRET,
                                                       "SPLITSERVE_KV_ALLOWED_PEERS": "192.168.7.0/24"})
    assert env_cfg.side_channel_secret == SECRET.encode() and env_cfg.allowed_peers == ("192.168.7.0/24",)
    assert parse_nixl_config(kv_config("default"), env={}).allowed_peers == ("127.0.0.0/8", "::1/128")
    for bad in ({"kv_side_channel_secret": "short"}, {"kv_allowed_peers": "10.0.0.0/33"},
                {"kv_allowed_peers": "not a host!"}, {"kv_allowed_peers": ""}, {"kv_lease_budget_fraction": 0}):
        with pytest.raises(ValueError):
            parse_nixl_config(kv_config("bad", **bad), env={})
