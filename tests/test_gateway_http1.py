"""The gateway's chunked-body parser (gateway/http1.py): the same chunks however the bytes arrive."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.gateway.http1 import _dechunk


def chunked(chunks: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n" + trailers + b"\r\n"


def parse(raw: bytes, cuts: list[int]) -> list[bytes]:
    async def run() -> list[bytes]:
        reader = asyncio.StreamReader()
        pieces = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
        for a, b in zip(pieces, pieces[1:]):
            reader.feed_data(raw[a:b])
        reader.feed_eof()
        return [c async for c in _dechunk(reader)]

    return asyncio.run(run())


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
    (b"5\r\nhello\r\n", asyncio.IncompleteReadError),  # no last chunk: the server went away
    (b"5\r\nhelloXY0\r\n\r\n", ValueError),  # chunk not followed by CRLF
    (b"zz\r\nhello\r\n0\r\n\r\n", ValueError),  # size not hex
    (b"0\r\n\r\nHTTP/1.1 200", ValueError),  # bytes after the body: the connection must not be reused
])
def test_broken_bodies_raise(raw, error):
    with pytest.raises(error):
        parse(raw, [])
