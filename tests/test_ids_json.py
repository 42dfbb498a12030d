"""A run of token ids as JSON items (render_service/tokenize/ids_json.py): orjson's path on 32-bit arrays writes
what msgspec writes, for every digit count, and lists take msgspec's path."""

from __future__ import annotations

import array

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from render_service.tokenize import ids_json as module
from render_service.tokenize.ids_json import ids_json


def msgspec_items(ids: list[int]) -> bytes:
    return msgspec.json.encode(ids)[1:-1]


def test_orjson_is_the_backend_where_it_is_installed():
    pytest.importorskip("orjson")
    assert module.BACKEND.startswith("orjson"), module.BACKEND


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=400))
def test_an_array_of_ids_is_written_as_msgspec_writes_it(ids):
    assert ids_json(array.array("I", ids)) == msgspec_items(ids)


@given(st.lists(st.integers(min_value=0, max_value=2**40), max_size=50))
def test_lists_and_tuples_take_msgspec(ids):
    assert ids_json(ids) == ids_json(tuple(ids)) == msgspec_items(ids)


def test_slices_of_one_array_are_written_alone():
    flat = array.array("I", range(0, 2_000_000, 9_973))
    assert ids_json(flat[5:9]) == b",".join(str(i).encode() for i in flat[5:9])
    assert ids_json(flat[3:3]) == b""


def test_an_array_of_another_type_is_not_misread():
    assert ids_json(array.array("q", [1, 2**40])) == b"1,1099511627776"
