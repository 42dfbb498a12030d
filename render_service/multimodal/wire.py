"""vLLM's wire encoding of one processed image (``features.kwargs_data`` and ``features.mm_metadata`` items):
base64 of the msgpack vLLM's ``MsgpackEncoder`` writes for a ``MultiModalKwargsItem`` with every tensor inline.
An item maps each field name to ``{"data": [dtype, shape, Ext(3, raw bytes)], "field": [factory, kwargs]}``;
the Qwen-VL families have ``pixel_values`` (flat over patches) and ``image_grid_thw`` (batched, kept on the CPU
as M-RoPE metadata). Written without torch: the render tier has none."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable

import msgspec

_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW: a tensor's bytes inline
_encode = msgspec.msgpack.Encoder().encode


def _proved_b64encode() -> Callable[[bytes], bytes]:
    """pybase64's SIMD encoder (about 15x the standard library's on a 1080p image's 12.6 MB), used only where it
    gives the standard library's bytes on a sample of every byte value at every length mod 3; else the stdlib's."""
    try:
        import pybase64
    except ImportError:
        return base64.b64encode
    sample = bytes(range(256)) * 3 + b"\x00\xff\x80"
    for size in (0, 1, 2, 3, 4, 5, 57, 58, 59, len(sample)):
        if pybase64.b64encode(sample[:size]) != base64.b64encode(sample[:size]):
            return base64.b64encode
    fast: Callable[[bytes], bytes] = pybase64.b64encode
    return fast


b64encode = _proved_b64encode()


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes | memoryview
            ) -> tuple[str, tuple[int, ...], msgspec.msgpack.Ext]:
    return dtype, shape, msgspec.msgpack.Ext(_RAW_VIEW, data)


def _grid_elem(grid: tuple[int, int, int]) -> dict[str, object]:
    return {"data": _tensor("int64", (3,), struct.pack("<3q", *grid)),
            "field": ("batched", {"keep_on_cpu": True})}


def kwargs_item(pixel_values: bytes | memoryview, dtype: str, rows: int, patch_dim: int,
                grid: tuple[int, int, int]) -> bytes:
    """The image's full item: ``pixel_values`` (rows x patch_dim, C order, read once; uint8 raw pixels for an
    engine that normalises on its device, float32 normalised values otherwise) and its grid. Its flat field
    slices the item alone (vLLM's own render slices the request's batch, so a multi-image request's strings differ
    from vLLM's; engines compare only the field's type when they batch items, and both decode to the same
    tensors)."""
    item = {
        "pixel_values": {"data": _tensor(dtype, (rows, patch_dim), pixel_values),
                         "field": ("flat", {"keep_on_cpu": False, "slices": [[(0, rows, None)]], "dim": 0})},
        "image_grid_thw": _grid_elem(grid),
    }
    # As the JSON string it is written as (base64 needs no escaping): the answer embeds it as it is (msgspec.Raw),
    # without a second pass over megabytes.
    return b"".join((b'"', b64encode(_encode(item)), b'"'))


def metadata_item(grid: tuple[int, int, int]) -> str:
    """The metadata-only item (fields kept on the CPU or declared as embedding metadata): the grid."""
    return base64.b64encode(_encode({"image_grid_thw": _grid_elem(grid)})).decode("ascii")
