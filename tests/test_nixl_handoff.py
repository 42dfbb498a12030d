"""KV handoff between two real processes over NIXL/UCX on loopback: the decode side (this process) pulls
blocks from a prefill-like peer process (token_engine.kv_tools.loopback_peer) holding them under leases."""

import os
import random
import signal
import time

import pytest
import torch

from token_engine.kv_connector.handoff import KVHandoff
from token_engine.kv_connector.handoff_types import RemoteKV
from token_engine.kv_connector.nixl_transport import NixlTransport
from token_engine.kv_connector.side_channel import fetch_publication
from token_engine.kv_tools.loopback_peer import PEER_TOKEN_HASH, LoopbackPeer, expected_block, make_pool

GEOM = ["--blocks", "64", "--layers", "2", "--block-size", "16", "--heads", "2", "--head-dim", "16"]
HANG_GUARD_S = 600  # only stops a broken test from hanging CI; no assertion depends on time
# Leases and loads that no test here waits out: a busy machine can stall a test for minutes, never for this.
# The tests about expiry move the peer's lease clock on explicitly (LoopbackPeer.advance).
NEVER_S = 24 * 3600
PEER_ARGS = [*GEOM, "--lease", str(NEVER_S)]


def _pool():
    return make_pool(64, 2, 16, 2, 16, "bfloat16")


def _wait_outcomes(h: KVHandoff, n: int = 1):
    outcomes = []
    stop = time.monotonic() + HANG_GUARD_S
    while len(outcomes) < n:
        assert time.monotonic() < stop, "handoff never reported"
        outcomes += h.poll().loads
        time.sleep(0.0005)
    return outcomes


def _wait_peer(peer: LoopbackPeer, cond):
    stop = time.monotonic() + HANG_GUARD_S
    while True:
        state = peer.state()
        if cond(state):
            return state
        assert time.monotonic() < stop, f"peer never reached the state: {state}"
        time.sleep(0.01)


def _remote(peer: LoopbackPeer, rid: str, blocks: list[int], epoch: int) -> RemoteKV:
    return RemoteKV(peer.engine_id, "127.0.0.1", peer.port, rid, epoch, tuple(blocks), PEER_TOKEN_HASH)


def _blocks_match(pool, local_ids, remote_ids, seed=1):
    return all(torch.equal(pool[lb].reshape(-1), expected_block(pool.shape, pool.dtype, rb, seed))
               for lb, rb in zip(local_ids, remote_ids))


@pytest.fixture(scope="module")
def peer():
    p = LoopbackPeer(*PEER_ARGS, "--engine-id", "prefill-shared")
    yield p
    p.close()


@pytest.fixture
def decode():
    h = KVHandoff(f"decode-{random.getrandbits(32):x}", _pool(), load_timeout_s=NEVER_S)
    yield h
    h.close()


def test_handoff_copies_the_exact_blocks_and_frees_the_lease(peer, decode):
    remote_ids, local_ids = [5, 6, 7, 8, 30], [40, 41, 42, 43, 2]
    epoch = peer.hold("req-a", remote_ids)
    decode.start_load("local-a", _remote(peer, "req-a", remote_ids, epoch), local_ids)
    [out] = _wait_outcomes(decode)
    assert out.ok, out.error
    assert out.descriptors == 2  # 5,6,7,8 -> 40..43 merge; 30 -> 2 stands alone
    assert out.bytes == 5 * decode.transport.layout.geometry.block_bytes
    assert _blocks_match(decode.transport._kv_pool, local_ids, remote_ids)
    state = _wait_peer(peer, lambda s: s["leases"] == 0)
    assert state["held_blocks"] == 0


def test_many_sequential_handoffs_reuse_one_connection(peer, decode):
    pool = decode.transport._kv_pool
    for i in range(8):
        remote_ids = random.sample(range(64), 4)
        local_ids = random.sample(range(64), 4)
        epoch = peer.hold(f"seq-{i}", remote_ids)
        decode.start_load(f"l{i}", _remote(peer, f"seq-{i}", remote_ids, epoch), local_ids)
        [out] = _wait_outcomes(decode)
        assert out.ok, out.error
        assert _blocks_match(pool, local_ids, remote_ids)
    _wait_peer(peer, lambda s: s["leases"] == 0)


def test_same_lease_cannot_be_loaded_twice(peer, decode):
    epoch = peer.hold("twice", [1])
    decode.start_load("t1", _remote(peer, "twice", [1], epoch), [1])
    assert _wait_outcomes(decode)[0].ok
    with pytest.raises(Exception, match="already loaded"):
        decode.start_load("t2", _remote(peer, "twice", [1], epoch), [2])


def test_forged_epoch_is_refused_as_stale(peer, decode):
    epoch = peer.hold("forged", [3])
    decode.start_load("f", _remote(peer, "forged", [3], epoch + 1), [3])
    [out] = _wait_outcomes(decode)
    assert not out.ok and out.reason == "stale"
    assert peer.ask(op="release", request_id="forged", epoch=epoch)["released"]


def test_expired_lease_frees_blocks_and_a_late_read_is_refused(peer, decode):
    _wait_peer(peer, lambda s: s["leases"] == 0)  # earlier tests' leases have ended
    epoch = peer.hold("late", [9, 10], lease_s=60)
    assert len(peer.lease_expires_in("late")) == 1  # held: nothing expires by itself here
    peer.advance(61)  # past this lease, not past the peer's default one
    state = _wait_peer(peer, lambda s: ["late", epoch] in s["freed"])
    assert state["held_blocks"] == 0
    decode.start_load("late-local", _remote(peer, "late", [9, 10], epoch), [0, 1])
    [out] = _wait_outcomes(decode)
    # NIXL would happily read the (possibly recycled) blocks; the lease check refuses them
    assert not out.ok and out.reason == "stale"


def test_killed_then_restarted_peer_is_removed_and_re_added():
    first = LoopbackPeer(*PEER_ARGS, "--engine-id", "prefill-phoenix")
    port = first.port
    h = KVHandoff("decode-phoenix", _pool(), load_timeout_s=NEVER_S)
    try:
        e1 = first.hold("before", [4])
        h.start_load("b", _remote(first, "before", [4], e1), [4])
        assert _wait_outcomes(h)[0].ok
        stale_epoch = first.hold("lost", [5])
        # Killed mid-handoff, deterministically: stopped, the peer still serves the READ (CMA copies without
        # it, as cuda_ipc does from a dead GPU peer), but cannot confirm the lease; then it dies.
        os.kill(first.proc.pid, signal.SIGSTOP)
        h.start_load("dead", _remote(first, "lost", [5], stale_epoch), [5])
        first.kill()
        [out] = _wait_outcomes(h)
        assert not out.ok and out.reason in ("disconnect", "side_channel")
        # the dead peer, again: READ (or the side channel) fails fast with a clear reason
        h.start_load("dead-2", _remote(first, "lost", [6], stale_epoch + 1), [6])
        [out] = _wait_outcomes(h)
        assert not out.ok and out.reason in ("disconnect", "side_channel")
        second = LoopbackPeer(*PEER_ARGS, "--engine-id", "prefill-phoenix", "--port", str(port), "--seed", "2")
        try:
            assert second.incarnation != first.incarnation
            # a fresh lease from the new incarnation works over the same agent name (remove, then add)
            e3 = second.hold("after", [6, 7])
            h.start_load("a", _remote(second, "after", [6, 7], e3), [6, 7])
            [out] = _wait_outcomes(h)
            assert out.ok, out.error
            assert _blocks_match(h.transport._kv_pool, [6, 7], [6, 7], seed=2)
            # a lease granted by the dead incarnation: its blocks are gone, whatever the new pool holds there
            h.start_load("lost", _remote(second, "lost", [5], stale_epoch), [5])
            [out] = _wait_outcomes(h)
            assert not out.ok and out.reason == "stale"
        finally:
            second.close()
    finally:
        h.close()
        first.kill()


def test_read_from_a_stuck_peer_hits_our_deadline():
    # a peer of its own: a stopped and resumed process is no peer for the other tests to share
    peer = LoopbackPeer(*PEER_ARGS, "--engine-id", "prefill-stuck")
    t = NixlTransport("decode-stuck", _pool())
    try:
        pub, layout = fetch_publication("127.0.0.1", peer.port)
        name = t.add_peer(pub, layout)
        os.kill(peer.proc.pid, signal.SIGSTOP)  # alive but never progresses: the first READ cannot wire up
        read_id = t.start_read(name, [0], [0], b"read:x:1", timeout_s=0.5)
        stop = time.monotonic() + HANG_GUARD_S
        results = []
        while not results:
            assert time.monotonic() < stop
            results = t.poll().reads
            time.sleep(0.002)
        [r] = results
        assert r.read_id == read_id and not r.ok and r.reason == "timeout"
        assert t.inflight() == 0
    finally:
        t.close()
        peer.kill()


def test_random_aborts_leak_no_blocks_on_either_side(peer):
    """Bounded soak: 40 handoffs, a third cancelled while in flight and a few never loaded (aborted on the
    prefill side). Every decode load reports exactly once and the prefill peer ends with zero held blocks once
    its leases' lifetime is over."""
    h = KVHandoff("decode-soak", _pool(), load_timeout_s=NEVER_S)
    rng = random.Random(5)
    try:
        pending = {}
        for i in range(40):
            remote_ids = rng.sample(range(64), rng.randint(1, 6))
            rid = f"soak-{i}"
            epoch = peer.hold(rid, remote_ids, lease_s=60)
            if rng.random() < 0.1:
                assert peer.ask(op="release", request_id=rid, epoch=epoch)["released"]
                continue
            h.start_load(rid, _remote(peer, rid, remote_ids, epoch), rng.sample(range(64), len(remote_ids)))
            pending[rid] = True
            if rng.random() < 0.33:
                h.cancel_load(rid)
                pending[rid] = False
            if len(pending) >= 4 or i == 39:
                outs = _wait_outcomes(h, len(pending))
                assert sorted(o.request_id for o in outs) == sorted(pending)
                for o in outs:
                    assert o.ok == pending[o.request_id], o
                pending.clear()
        assert h.loading() == 0
        # A cancelled load's abort is a NIXL notification, delivered while decode drives progress for a short
        # window after it; a busy machine can miss that window, and then the lease ends by expiry, as it would
        # in an engine. Drive that expiry instead of waiting it out.
        peer.advance(61)
        _wait_peer(peer, lambda s: s["leases"] == 0 and s["held_blocks"] == 0)
    finally:
        h.close()


def test_load_completes_during_a_long_engine_step(peer, decode):
    """No poll() from the engine (as during a long forward step): the poller thread still finishes the READ
    and the lease confirmation, so the very next poll() reports the load done."""
    epoch = peer.hold("busy-step", [11, 12, 13])
    decode.start_load("busy-local", _remote(peer, "busy-step", [11, 12, 13], epoch), [20, 21, 22])
    stop = time.monotonic() + HANG_GUARD_S
    while decode.loading():
        assert time.monotonic() < stop, "the load never finished without the engine polling"
        time.sleep(0.005)
    [out] = decode.poll().loads
    assert out.ok and out.request_id == "busy-local"
    assert _blocks_match(decode.transport._kv_pool, [20, 21, 22], [11, 12, 13])


def test_loads_from_one_peer_share_one_side_channel_link_and_agent(peer, decode):
    links = set()
    for i in range(4):
        epoch = peer.hold(f"link-{i}", [i])
        decode.start_load(f"link-local-{i}", _remote(peer, f"link-{i}", [i], epoch), [i + 10])
        [out] = _wait_outcomes(decode)
        assert out.ok, out.error
        [known] = decode.consumer._peers.values()
        links.add(id(known.link))
    assert len(links) == 1 and not known.link.closed


def test_heartbeat_contacts_an_unknown_peer_then_keeps_its_lease_past_expiry(peer, decode):
    contact_epoch = peer.hold("hb-contact", [16])
    stop = time.monotonic() + HANG_GUARD_S
    while not decode.heartbeat(_remote(peer, "hb-contact", [16], contact_epoch)):  # starts a background contact
        assert time.monotonic() < stop, "peer never became known"
        decode.poll()
        time.sleep(0.01)
    assert peer.ask(op="release", request_id="hb-contact", epoch=contact_epoch)["released"]
    epoch = peer.hold("hb", [14, 15], lease_s=60)
    control = peer.hold("hb-control", [17], lease_s=60)  # the same lease without heartbeats
    remote = _remote(peer, "hb", [14, 15], epoch)
    assert decode.heartbeat(remote)  # extends the lease to 2/3 of the peer's lease duration from now
    # wait for the peer to have applied it (a NIXL notification arrives when it arrives)
    stop = time.monotonic() + HANG_GUARD_S
    while peer.lease_expires_in("hb")[0] <= 60:
        assert time.monotonic() < stop, "the heartbeat never reached the peer"
        decode.poll()
        time.sleep(0.01)
    peer.advance(120)  # the lease's own 60 s are over: without the heartbeat it expires now, as the control does
    state = _wait_peer(peer, lambda s: ["hb-control", control] in s["freed"])
    assert ["hb", epoch] not in state["freed"] and len(peer.lease_expires_in("hb")) == 1
    decode.start_load("hb-local", remote, [30, 31])
    [out] = _wait_outcomes(decode)
    assert out.ok, out.error
    assert _blocks_match(decode.transport._kv_pool, [30, 31], [14, 15])


def test_two_readers_of_one_lease_never_both_succeed(peer, decode):
    """The lease is pinned to the first reader: a second decode (a proxy retry, say) is refused as stale,
    so no READ can see blocks freed by the other's READ notification."""
    other = KVHandoff(f"decode-2nd-{random.getrandbits(32):x}", _pool(), load_timeout_s=NEVER_S)
    try:
        epoch = peer.hold("shared", [40, 41, 42])
        remote = _remote(peer, "shared", [40, 41, 42], epoch)
        decode.start_load("first", remote, [1, 2, 3])
        other.start_load("second", remote, [4, 5, 6])
        outs = _wait_outcomes(decode) + _wait_outcomes(other)
        assert sorted(o.ok for o in outs) == [False, True]
        assert [o.reason for o in outs if not o.ok] == ["stale"]
    finally:
        other.close()
