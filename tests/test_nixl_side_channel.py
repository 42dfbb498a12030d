"""Side channel: publishes agent metadata, pool address and geometry; everything received is validated."""

import socket
import struct
import threading

import msgspec
import pytest

from token_engine.kv_connector.side_channel import (
    AgentPublication,
    SideChannelError,
    SideChannelServer,
    WireGeometry,
    fetch_lease_status,
    fetch_publication,
    validate_publication,
)


def _pub(**over) -> AgentPublication:
    fields = dict(engine_id="prefill-0", agent_name="prefill-0", agent_metadata=b"\x01" * 463, incarnation=9,
                  base_addr=0x7F0000000000, mem_type="DRAM", device_id=0,
                  geometry=WireGeometry(64, 2, 16, 2, 16, "bfloat16"))
    fields.update(over)
    return AgentPublication(**fields)


def test_publication_round_trips_over_tcp():
    server = SideChannelServer(_pub())
    try:
        pub, layout = fetch_publication("127.0.0.1", server.port)
        assert pub == _pub()
        assert layout.base_addr == 0x7F0000000000 and layout.geometry.block_bytes == 2 * 2 * 16 * 2 * 16 * 2
    finally:
        server.close()


def test_lease_status_is_answered_by_the_callback():
    asked = []

    def status(rid, epoch, reader):
        asked.append((rid, epoch, reader))
        return "held" if rid == "live" else "gone"

    server = SideChannelServer(_pub(), status)
    try:
        assert fetch_lease_status("127.0.0.1", server.port, "live", 5, "decode-1") == "held"
        assert fetch_lease_status("127.0.0.1", server.port, "dead", 6, "decode-1") == "gone"
        assert asked == [("live", 5, "decode-1"), ("dead", 6, "decode-1")]
    finally:
        server.close()


@pytest.mark.parametrize("over", [
    dict(geometry=WireGeometry(0, 2, 16, 2, 16, "bfloat16")),
    dict(geometry=WireGeometry(64, 2, 16, 2, 16, "int4")),
    dict(geometry=WireGeometry(64, -2, 16, 2, 16, "bfloat16")),
    dict(base_addr=0),
    dict(base_addr=(1 << 64) - 10),
    dict(mem_type="FILE"),
    dict(tp_size=2),
    dict(agent_metadata=b""),
    dict(agent_metadata=b"x" * (300 << 10)),
    dict(engine_id=""),
])
def test_validation_rejects_bad_publications(over):
    with pytest.raises(SideChannelError):
        validate_publication(_pub(**over))


def _serve_raw(payload: bytes) -> tuple[int, threading.Thread]:
    """A hostile peer: answers any connection with `payload` verbatim."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def run():
        conn, _ = sock.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(payload)
        sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return sock.getsockname()[1], t


@pytest.mark.parametrize("payload", [
    struct.pack("!I", 5) + b"nope!",                                   # not JSON
    struct.pack("!I", 1 << 30),                                        # absurd frame length
    struct.pack("!I", 100) + b"{}",                                    # closed mid-frame
    (lambda b: struct.pack("!I", len(b)) + b)(b'{"engine_id": 3}'),  # wrong types
    (lambda b: struct.pack("!I", len(b)) + b)(msgspec.json.encode({**msgspec.to_builtins(_pub()), "pickle": 1})),
])
def test_fetch_rejects_hostile_answers(payload):
    port, t = _serve_raw(payload)
    with pytest.raises(SideChannelError):
        fetch_publication("127.0.0.1", port, timeout_s=5)
    t.join(5)


def test_server_survives_garbage_clients():
    server = SideChannelServer(_pub())
    try:
        for junk in (b"\xff\xff\xff\xff", struct.pack("!I", 3) + b"abc", b""):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(junk)
        assert fetch_publication("127.0.0.1", server.port)[0].engine_id == "prefill-0"
    finally:
        server.close()


def test_unreachable_peer_is_a_side_channel_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(SideChannelError):
        fetch_publication("127.0.0.1", port, timeout_s=2)
    with pytest.raises(SideChannelError):
        fetch_publication("127.0.0.1", 70000)


def test_one_kept_open_link_carries_the_publication_and_many_pinned_queries():
    from token_engine.kv_connector.side_channel import open_link

    pins = []

    def pin(rid, epoch, reader, pin_s, block_ids, token_hash):
        pins.append((rid, epoch, reader, pin_s))
        return ("held", min(pin_s, 2.0)) if rid != "dead" else ("gone", 0.0)

    server = SideChannelServer(_pub(), lambda rid, epoch, reader: "held", lease_pin=pin)
    try:
        pub, layout, link = open_link("127.0.0.1", server.port)
        assert pub == _pub() and link.alive()
        for i in range(5):
            link.ask(f"r{i}", i, "decode-1", pin_s=7.5)
        link.ask("dead", 9, "decode-1", pin_s=1.0)
        link.ask("plain", 10, "decode-1")  # no pin: answered by the status callback
        answers = []
        while len(answers) < 7:
            answers += link.answers()
        assert [(a.request_id, a.epoch, a.status, a.pinned_s) for a in answers] == (
            [(f"r{i}", i, "held", 2.0) for i in range(5)] + [("dead", 9, "gone", 0.0), ("plain", 10, "held", 0.0)])
        assert len(pins) == 6 and all(p[2:] == ("decode-1", 7.5) for p in pins[:5])
        link.close()
    finally:
        server.close()


def test_a_link_notices_the_server_going_away():
    from token_engine.kv_connector.side_channel import open_link

    server = SideChannelServer(_pub(), lambda rid, epoch, reader: "held")
    pub, layout, link = open_link("127.0.0.1", server.port)
    link.ask("x", 1, "d")
    while not link.answers():
        pass
    server.close()  # closes kept-open connections too: the link reports it instead of waiting forever
    with pytest.raises(SideChannelError):
        for _ in range(1_000_000):
            link.answers()
    assert not link.alive()
