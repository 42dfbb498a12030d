"""vLLM's wire encoding of one processed image (``features.kwargs_data`` and ``features.mm_metadata`` items):
base64 of the msgpack vLLM's ``MsgpackEncoder`` writes for a ``MultiModalKwargsItem`` with every tensor inline.
An item maps each field name to ``{"data": [dtype, shape, Ext(3, raw bytes)], "field": [factory, kwargs]}``;
the Qwen-VL families have ``pixel_values`` (flat over patches) and ``image_grid_thw`` (batched, kept on the CPU
as M-RoPE metadata). Written without torch: the render tier has none."""

from __future__ import annotations

import base64
import struct

import msgspec

_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW: a tensor's bytes inline
_encode = msgspec.msgpack.Encoder().encode


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes | memoryview
            ) -> tuple[str, tuple[int, ...], msgspec.msgpack.Ext]:
    return dtype, shape, msgspec.msgpack.Ext(_RAW_VIEW, data)


def _grid_elem(grid: tuple[int, int, int]) -> dict[str, object]:
    return {"data": _tensor("int64", (3,), struct.pack("<3q", *grid)),
            "field": ("batched", {"keep_on_cpu": True})}


def kwargs_item(pixel_values: bytes | memoryview, dtype: str, rows: int, patch_dim: int,
                grid: tuple[int, int, int]) -> str:
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
    return base64.b64encode(_encode(item)).decode("ascii")


def metadata_item(grid: tuple[int, int, int]) -> str:
    """The metadata-only item (fields kept on the CPU or declared as embedding metadata): the grid."""
    return base64.b64encode(_encode({"image_grid_thw": _grid_elem(grid)})).decode("ascii")
