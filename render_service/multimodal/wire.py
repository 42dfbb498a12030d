"""vLLM's wire encoding of one processed image (``features.kwargs_data`` and ``features.mm_metadata`` items):
base64 of the msgpack vLLM's ``MsgpackEncoder`` writes for a ``MultiModalKwargsItem`` with every tensor inline.
An item maps each field name to ``{"data": [dtype, shape, Ext(3, raw bytes)], "field": [factory, kwargs]}``;
the Qwen-VL families have ``pixel_values`` (flat over patches) and ``image_grid_thw`` (batched, kept on the CPU
as M-RoPE metadata); Gemma 4 has ``pixel_values`` and ``pixel_position_ids``, both batched. Written without
torch: the render tier has none."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable

import msgspec

_RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW: a tensor's bytes inline
_encode = msgspec.msgpack.Encoder().encode


def _proved_b64encode() -> Callable[[bytes | memoryview], bytes]:
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
    fast: Callable[[bytes | memoryview], bytes] = pybase64.b64encode
    return fast


b64encode = _proved_b64encode()


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes | memoryview
            ) -> tuple[str, tuple[int, ...], msgspec.msgpack.Ext]:
    return dtype, shape, msgspec.msgpack.Ext(_RAW_VIEW, data)


def _grid_elem(grid: tuple[int, int, int]) -> dict[str, object]:
    return {"data": _tensor("int64", (3,), struct.pack("<3q", *grid)),
            "field": ("batched", {"keep_on_cpu": True})}


def _ext_header(size: int) -> bytes:
    """msgpack's header of a raw-view ext of ``size`` bytes, as msgspec writes it (fixext, ext8/16/32)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}.get(size)
    if fixed is not None:
        return bytes((fixed, _RAW_VIEW))
    if size < 1 << 8:
        return struct.pack(">BBb", 0xC7, size, _RAW_VIEW)
    if size < 1 << 16:
        return struct.pack(">BHb", 0xC8, size, _RAW_VIEW)
    return struct.pack(">BIb", 0xC9, size, _RAW_VIEW)


_MARK = b"splitserve-pixel-values-placeholder"  # (an ext8 of its own length: its header is found with it)


class ItemLayout(msgspec.Struct, frozen=True):
    """One image's full item as msgpack bytes around its pixel values: ``prefix``, the ``size`` raw bytes,
    ``suffix``. A worker writes the pixel values straight between the two, with no copy through an encoder."""

    prefix: bytes
    size: int
    suffix: bytes

    @property
    def total(self) -> int:
        return len(self.prefix) + self.size + len(self.suffix)


_ITEMSIZE = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4}


def _layout(item: dict[str, object], size: int) -> ItemLayout:
    """``item`` (its pixel values' data ``_MARK``) split around where ``size`` bytes of pixel values go."""
    encoded = _encode(item)
    marked = _ext_header(len(_MARK)) + _MARK
    at = encoded.index(marked)
    return ItemLayout(encoded[:at] + _ext_header(size), size, encoded[at + len(marked):])


def item_layout(dtype: str, rows: int, patch_dim: int, grid: tuple[int, int, int]) -> ItemLayout:
    """The layout of the image's full item: ``pixel_values`` (rows x patch_dim of ``dtype``, C order; uint8 raw
    pixels for an engine that normalises on its device, float32 normalised values otherwise) and its grid. Its
    flat field slices the item alone (vLLM's own render slices the request's batch, so a multi-image request's
    strings differ from vLLM's; engines compare only the field's type when they batch items, and both decode to
    the same tensors)."""
    item: dict[str, object] = {
        "pixel_values": {"data": _tensor(dtype, (rows, patch_dim), _MARK),
                         "field": ("flat", {"keep_on_cpu": False, "slices": [[(0, rows, None)]], "dim": 0})},
        "image_grid_thw": _grid_elem(grid),
    }
    return _layout(item, rows * patch_dim * _ITEMSIZE[dtype])


def budget_item_layout(dtype: str, rows: int, patch_dim: int, positions: bytes) -> ItemLayout:
    """Gemma 4's item: ``pixel_values`` (rows x patch_dim of ``dtype``, padded to the budget's patches) and int64
    ``pixel_position_ids`` (rows x 2, ``positions``), both batched fields on the device, as vLLM's Gemma 4 model
    declares them."""
    batched = ("batched", {"keep_on_cpu": False})
    item: dict[str, object] = {
        "pixel_values": {"data": _tensor(dtype, (rows, patch_dim), _MARK), "field": batched},
        "pixel_position_ids": {"data": _tensor("int64", (rows, 2), positions), "field": batched},
    }
    return _layout(item, rows * patch_dim * _ITEMSIZE[dtype])


def quoted_base64(item: bytes | memoryview) -> bytes:
    """An item as the JSON string it is written as (base64 needs no escaping): the answer embeds it as it is
    (msgspec.Raw), without a second pass over megabytes."""
    return b"".join((b'"', b64encode(item), b'"'))


def kwargs_item(pixel_values: bytes | memoryview, dtype: str, rows: int, patch_dim: int,
                grid: tuple[int, int, int]) -> bytes:
    """The image's full item (``item_layout``) with ``pixel_values`` (read once), as its JSON string."""
    layout = item_layout(dtype, rows, patch_dim, grid)
    return quoted_base64(b"".join((layout.prefix, pixel_values, layout.suffix)))


def metadata_item(grid: tuple[int, int, int]) -> str:
    """The metadata-only item (fields kept on the CPU or declared as embedding metadata): the grid."""
    return base64.b64encode(_encode({"image_grid_thw": _grid_elem(grid)})).decode("ascii")
