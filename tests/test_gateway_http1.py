"""The gateway's engine read path: the chunked-body parser (gateway/http1.py) and the SSE event splitter
(gateway/engine_client.py) give the same events however the bytes arrive, and broken bodies raise; the
keep-alive pool against a loopback server (reuse, a connection closed while idle, a body cut short)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.gateway.engine_client import SseEvents
from render_service.gateway.http1 import ChunkedDecoder, Http1Pool, HttpError


def chunked(chunks: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n" + trailers + b"\r\n"


def parse(raw: bytes, cuts: list[int]) -> list[bytes]:
    """Feed ``raw`` cut at ``cuts``; an unfinished body raises EOFError (the server went away)."""
    body = ChunkedDecoder()
    pieces = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    out = []
    for a, b in zip(pieces, pieces[1:]):
        out += body.feed(raw[a:b])
    if not body.done:
        raise EOFError(body.pending)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), max_size=6), st.lists(st.integers(0, 10_000), max_size=8),
       st.booleans())
def test_chunks_survive_any_split_of_the_bytes(chunks, cuts, with_trailers):
    trailers = b"x-trailer: 1\r\n" if with_trailers else b""
    assert parse(chunked(chunks, trailers), cuts) == chunks


def test_a_chunk_larger_than_one_read_comes_whole():
    big = bytes(range(256)) * 1000
    assert parse(chunked([b"data: a\n\n", big]), [3, 70_000]) == [b"data: a\n\n", big]


@pytest.mark.parametrize("raw, error", [
    (b"5\r\nhello\r\n", EOFError),  # no last chunk: the server went away
    (b"5\r\nhelloXY0\r\n\r\n", ValueError),  # chunk not followed by CRLF
    (b"zz\r\nhello\r\n0\r\n\r\n", ValueError),  # size not hex
    (b"0\r\n\r\nHTTP/1.1 200", ValueError),  # bytes after the body: the connection must not be reused
])
def test_broken_bodies_raise(raw, error):
    with pytest.raises(error):
        parse(raw, [])


def test_one_read_with_several_events_gives_them_all_at_once():
    raw = chunked([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"])
    body = ChunkedDecoder()
    assert body.feed(raw) == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"] and body.done


def test_bytes_after_a_finished_body_raise():
    body = ChunkedDecoder()
    body.feed(chunked([b"x"]))
    with pytest.raises(ValueError):
        body.feed(b"5\r\n")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([b'{"a": 1}', b"[DONE]", b'{"b": "x\\ny"}', b"{}"]), max_size=6),
       st.lists(st.integers(0, 500), max_size=8))
def test_sse_events_survive_any_split(payloads, cuts):
    stream = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    events = SseEvents()
    pieces = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    data = [d for a, b in zip(pieces, pieces[1:]) for d in events.feed(stream[a:b])]
    assert data + events.flush() == payloads


def test_an_event_without_its_blank_line_comes_out_at_the_end():
    events = SseEvents()
    assert events.feed(b"data: 1\n\ndata: 2") == [b"1"]
    assert events.flush() == [b"2"]


# ------------------------------------------------------------------------------- the pool, on loopback


def serve(responses: list[list[bytes]], close_after: set[int] = frozenset()):
    """A loopback server that answers the i-th request with ``responses[i]`` (written piece by piece,
    each piece a separate write) and closes the connection after the requests in ``close_after``."""
    seen: list[tuple[int, bytes]] = []  # (connection number, request)
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        me = connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                seen.append((me, head + await reader.readexactly(length)))
                index = len(seen) - 1
                for piece in responses[index]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if index in close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return handle, seen


def chunked_response(chunks: list[bytes]) -> bytes:
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(chunks)


async def with_server(handle, body):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Http1Pool(connect_timeout_s=5, header_timeout_s=30)
    try:
        return await body(pool, f"http://127.0.0.1:{port}/inference/v1/generate")
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


def test_the_pool_streams_chunks_and_reuses_the_connection():
    raw = chunked_response([b"data: 1\n\n", b"data: 2\n\n"])
    plain = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel", b"lo"]
    handle, seen = serve([[raw[:20], raw[20:60], raw[60:]], plain])

    async def body(pool, url):
        first = await pool.post(url, b'{"a": 1}', {"content-type": "application/json"})
        got = [c async for chunks in first.iter_chunk_lists() for c in chunks]
        second = await pool.post(url, b"{}", {})
        return first.status, got, await second.read()

    status, got, plain = asyncio.run(with_server(handle, body))
    assert (status, got, plain) == (200, [b"data: 1\n\n", b"data: 2\n\n"], b"hello")
    assert [c for c, _ in seen] == [1, 1], "the second request did not reuse the kept-alive connection"
    assert seen[0][1].startswith(b"POST /inference/v1/generate HTTP/1.1\r\n") and seen[0][1].endswith(b'{"a": 1}')


def test_a_connection_the_server_closed_while_idle_is_replaced():
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    handle, seen = serve([[ok], [ok]], close_after={0})

    async def body(pool, url):
        assert await (await pool.post(url, b"1", {})).read() == b"ok"
        await asyncio.sleep(0.05)  # the server's close arrives while the connection is idle
        return await (await pool.post(url, b"2", {})).read()

    assert asyncio.run(with_server(handle, body)) == b"ok"
    assert [c for c, _ in seen] == [1, 2]


def test_a_body_cut_short_raises_http_error():
    handle, _ = serve([[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel"]], close_after={0})

    async def body(pool, url):
        response = await pool.post(url, b"{}", {})
        with pytest.raises(HttpError):
            await response.read()

    asyncio.run(with_server(handle, body))


def test_a_server_that_never_answers_times_out_as_http_error():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the request, never answers, until the client goes away
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        pool = Http1Pool(connect_timeout_s=5, header_timeout_s=0.2)
        try:
            with pytest.raises(HttpError, match="timed out"):
                await pool.post(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x", b"{}", {})
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(run())


# ------------------------------------------------------------------ pushed bodies (the relay's read path)


def gated_server(parts: list[bytes], gate: asyncio.Event, then_close: bool = False):
    """Answers one request with ``parts[0]``, waits for ``gate``, writes the rest; optionally closes."""
    requests: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            requests.append(len(requests))
            if len(requests) > 1:  # a later request on the same connection: a short plain answer
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                continue
            writer.write(parts[0])
            await writer.drain()
            await gate.wait()
            for part in parts[1:]:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)
            if then_close:
                break
        writer.close()

    return handle, requests


def test_a_body_pulled_then_pushed_gives_every_chunk_once_and_the_connection_back():
    events = [b"data: %d\n\n" % i for i in range(6)]
    raw = chunked_response(events)
    split = raw.index(b"data: 2")  # the pull sees events 0 and 1, the push the rest, in three writes

    async def run():
        gate = asyncio.Event()
        handle, requests = gated_server([raw[:split], raw[split:split + 15], raw[split + 15:split + 40],
                                         raw[split + 40:]], gate)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
        pool = Http1Pool(connect_timeout_s=5, header_timeout_s=30)
        try:
            response = await pool.post(url, b"{}", {})
            pulled = await response.next_chunks()
            pushed: list[bytes] = []
            ended = asyncio.get_running_loop().create_future()
            response.push_chunks(pushed.extend, ended.set_result)
            gate.set()
            error = await asyncio.wait_for(ended, 10)
            again = await (await pool.post(url, b"{}", {})).read()  # on the same, kept-alive connection
            return pulled, pushed, error, again, list(requests), response.finished
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    pulled, pushed, error, again, requests, finished = asyncio.run(run())
    assert pulled == events[:2] and pushed == events[2:] and error is None and finished
    assert again == b"ok" and requests == [0, 1], "the pushed body's connection was not reused"


def test_a_pushed_body_cut_short_ends_with_an_http_error():
    raw = chunked_response([b"data: 1\n\n", b"data: 2\n\n"])

    async def run():
        gate = asyncio.Event()
        handle, _ = gated_server([raw[:60], raw[60:-5]], gate, then_close=True)  # no last chunk, then a close
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = Http1Pool(connect_timeout_s=5, header_timeout_s=30)
        try:
            response = await pool.post(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x", b"{}", {})
            pushed: list[bytes] = []
            ended = asyncio.get_running_loop().create_future()
            response.push_chunks(pushed.extend, ended.set_result)
            gate.set()
            return pushed, await asyncio.wait_for(ended, 10)
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    pushed, error = asyncio.run(run())
    assert pushed == [b"data: 1\n\n", b"data: 2\n\n"]
    assert isinstance(error, HttpError) and error.started


def test_closing_a_pushed_body_from_its_callback_stops_it():
    events = [b"data: %d\n\n" % i for i in range(20)]
    raw = chunked_response(events)

    async def run():
        gate = asyncio.Event()
        head = raw.index(b"\r\n\r\n") + 4
        handle, _ = gated_server([raw[:head]] + [raw[i:i + 12] for i in range(head, len(raw), 12)], gate)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = Http1Pool(connect_timeout_s=5, header_timeout_s=30)
        try:
            response = await pool.post(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x", b"{}", {})
            pushed: list[bytes] = []
            ends: list = []

            def take(chunks: list[bytes]) -> None:
                pushed.extend(chunks)
                response.close()  # as the relay does when a stop string matched

            response.push_chunks(take, ends.append)
            gate.set()
            await asyncio.sleep(0.3)  # the server goes on writing; nothing more may arrive
            return pushed, ends, response.finished, pool._idle
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    pushed, ends, finished, idle = asyncio.run(run())
    assert 1 <= len(pushed) < len(events) and pushed == events[:len(pushed)]
    assert ends == [] and finished and not any(idle.values()), "a closed body's connection was pooled"
