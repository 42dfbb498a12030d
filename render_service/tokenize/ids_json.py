"""The JSON text of a run of token ids without its brackets (``b"1,2,3"``): what the piece cache keeps beside a
piece's ids, and what a cold prompt's answer is joined from.

msgspec needs a Python int for every id (``array.tolist()``, then its encoder: about 20 ns an id). orjson writes
a numpy view of the 32-bit array the fastokens path returns without making any (about 7 ns an id; a cold
131k-token prompt's ids in 1 ms instead of 3). It is used where it is installed and where, at import, it writes
exactly what msgspec writes for ids of every length from 1 to 10 digits; otherwise msgspec answers.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

_msgspec_encode = msgspec.json.Encoder().encode


def _plain(ids: Sequence[int]) -> bytes:
    return _msgspec_encode(ids.tolist() if type(ids) is array.array else ids)[1:-1]


def _fast_writer() -> tuple[Callable[[np.ndarray], bytes] | None, str]:
    try:
        import orjson
    except ImportError:
        return None, "msgspec (orjson is not installed)"
    option = orjson.OPT_SERIALIZE_NUMPY

    def write(view: np.ndarray) -> bytes:
        return orjson.dumps(view, option=option)[1:-1]

    probe = array.array("I", [0, 7, 10, 99, 100, 151_643, 999_999, 1_000_000, 2**31 - 1, 2**31, 2**32 - 1,
                              *range(0, 300_000, 997)])
    try:
        if (write(np.frombuffer(probe, dtype=np.uint32)) != _plain(probe)
                or write(np.frombuffer(array.array("I"), dtype=np.uint32)) != b""):
            return None, "msgspec (orjson's numpy output differs from msgspec's here)"
    except Exception as exc:  # an orjson without numpy support
        return None, f"msgspec (orjson failed its check: {exc})"
    return write, "orjson on the ids' 32-bit buffer (proved equal to msgspec at import)"


# (the proof also covers an array("I") whose items are not 32-bit: its numpy view would not read the same ids)
_fast, BACKEND = _fast_writer()


def ids_json(ids: Sequence[int]) -> bytes:
    """``ids`` as JSON array items, ``b"1,2,3"`` (``b""`` for none)."""
    if _fast is not None and type(ids) is array.array and ids.typecode == "I":
        return _fast(np.frombuffer(ids, dtype=np.uint32))
    return _plain(ids)
