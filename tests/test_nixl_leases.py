"""Prefill leases: freed on decode's read notification or at expiry, never twice, never for a stale epoch."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from token_engine.kv_connector.leases import LeaseTable, format_notification, parse_notification


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_read_notification_ends_lease_and_is_remembered_for_that_reader_only():
    t = LeaseTable(30, incarnation=7, clock=FakeClock())
    lease = t.grant("req-1", [3, 4])
    assert t.status("req-1", lease.epoch, "decode-a") == "held"
    assert t.on_read("req-1", lease.epoch, "decode-a") is lease
    assert t.status("req-1", lease.epoch, "decode-a") == "read"
    assert t.status("req-1", lease.epoch, "decode-b") == "gone"
    assert t.on_read("req-1", lease.epoch, "decode-a") is None  # a second READ frees nothing


def test_epochs_are_unique_and_carry_the_incarnation():
    t = LeaseTable(30, incarnation=5, clock=FakeClock())
    a, b = t.grant("same-id", [1]), t.grant("same-id", [2])
    assert a.epoch != b.epoch and a.epoch >> 32 == b.epoch >> 32 == 5
    assert t.on_read("same-id", b.epoch, "d") is b and ("same-id", a.epoch) in t


def test_wrong_epoch_does_not_free():
    t = LeaseTable(30, incarnation=5, clock=FakeClock())
    lease = t.grant("r", [1])
    assert t.on_read("r", lease.epoch + 1, "d") is None
    assert t.on_read("r", (6 << 32) | 1, "d") is None  # the same counter from another incarnation
    assert len(t) == 1


def test_lease_expires_after_duration_and_status_turns_gone():
    clock = FakeClock()
    t = LeaseTable(30, clock=clock)
    lease = t.grant("r", [1, 2, 3])
    clock.now += 29.9
    assert t.expire() == []
    clock.now += 0.2
    assert t.expire() == [lease]
    assert t.status("r", lease.epoch, "d") == "gone"
    assert t.on_read("r", lease.epoch, "d") is None


def test_heartbeat_extends_to_two_thirds_of_the_lease_from_now():
    clock = FakeClock()
    t = LeaseTable(30, clock=clock)
    lease = t.grant("r", [1])
    clock.now += 25
    assert t.on_heartbeat("r", lease.epoch)
    assert lease.expires_at == clock.now + 20
    clock.now += 19
    assert t.expire() == []
    clock.now += 2
    assert t.expire() == [lease]
    assert not t.on_heartbeat("r", lease.epoch)


def test_heartbeat_never_shortens_a_lease():
    clock = FakeClock()
    t = LeaseTable(30, clock=clock)
    lease = t.grant("r", [1])
    t.on_heartbeat("r", lease.epoch)
    assert lease.expires_at == clock.now + 30


def test_notification_format_round_trips_and_request_ids_may_contain_colons():
    msg = format_notification("read", "cmpl-1:x:y", 12345)
    assert msg == b"read:cmpl-1:x:y:12345"
    n = parse_notification(msg)
    assert (n.kind, n.request_id, n.epoch) == ("read", "cmpl-1:x:y", 12345)
    assert parse_notification(b"HB:r:9").kind == "HB"
    assert parse_notification(b"abort:r:9").kind == "abort"


def test_malformed_notifications_are_ignored():
    for bad in (b"", b"read", b"read:r", b"read::5", b"read:r:-1", b"read:r:abc", b"free:r:1", b"\xff\xfe:r:1",
                b"read:" + b"x" * 5000 + b":1"):
        assert parse_notification(bad) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "read", "stale_read", "hb", "abort", "tick"]),
                          st.integers(0, 10 ** 6)), max_size=80))
def test_every_granted_block_is_freed_exactly_once(ops):
    """Random grants, reads, stale reads, heartbeats, aborts and clock ticks: when everything has ended,
    each granted block came back exactly once and none was handed back while still leased."""
    clock = FakeClock()
    t = LeaseTable(10, incarnation=3, clock=clock)
    rng = random.Random(0)
    free = set(range(64))
    live = []
    freed_twice = []

    def give_back(lease):
        for b in lease.block_ids:
            if b in free:
                freed_twice.append(b)
            free.add(b)

    for op, x in ops:
        if op == "grant" and len(free) >= 2:
            blocks = rng.sample(sorted(free), 2)
            free.difference_update(blocks)
            live.append(t.grant(f"r{x % 5}", blocks))
        elif op in ("read", "abort", "hb", "stale_read") and live:
            lease = live[x % len(live)]
            if op == "read":
                got = t.on_read(lease.request_id, lease.epoch, "d")
            elif op == "abort":
                got = t.release(lease.request_id, lease.epoch)
            elif op == "stale_read":
                got = t.on_read(lease.request_id, lease.epoch ^ (1 << 40), "d")  # same counter, other incarnation
                assert got is None
            else:
                t.on_heartbeat(lease.request_id, lease.epoch)
                got = None
            if got is not None:
                give_back(got)
        elif op == "tick":
            clock.now += x % 7
            for lease in t.expire():
                give_back(lease)
    clock.now += 100
    for lease in t.expire():
        give_back(lease)
    assert freed_twice == []
    assert free == set(range(64)) and len(t) == 0 and t.held_blocks() == 0


H = "ab" * 16  # the token hash the leases below were granted for


def test_pinned_lease_outlives_its_expiry_and_only_its_reader_ends_it():
    clock = FakeClock()
    t = LeaseTable(10, incarnation=3, clock=clock)
    lease = t.grant("r", [1, 2], duration_s=1, token_hash=H)
    assert t.pin("r", lease.epoch, "decode-a", 5.0, [1, 2], H) == ("held", 5.0)
    clock.now += 3  # past the lease's own expiry, within the pin
    assert t.expire() == []
    assert t.pin("r", lease.epoch, "decode-b", 5.0, [1, 2], H) == ("gone", 0.0)  # one reader per lease
    assert t.status("r", lease.epoch, "decode-b") == "gone"
    assert t.on_read("r", lease.epoch, "decode-b") is None  # another reader's READ must not free our blocks
    assert t.release("r", lease.epoch, reader="decode-b") is None
    assert t.on_read("r", lease.epoch, "decode-a") is lease
    assert t.status("r", lease.epoch, "decode-a") == "read"


def test_pin_is_capped_and_a_pin_past_its_time_expires():
    clock = FakeClock()
    t = LeaseTable(10, incarnation=3, clock=clock)
    lease = t.grant("r", [1], token_hash=H)
    status, pinned = t.pin("r", lease.epoch, "d", float("inf"), [1], H)
    assert status == "held" and pinned == 60.0  # max(lease duration, 60 s)
    assert t.pin("r", lease.epoch, "d", float("nan"), [1], H) == ("held", 0.0)
    clock.now += 61
    assert t.expire() == [lease]
    assert t.pin("r", lease.epoch, "d", 1.0, [1], H) == ("gone", 0.0)
