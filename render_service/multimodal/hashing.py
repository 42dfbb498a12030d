"""Content hashes of images, as vLLM computes its ``mm_hashes`` for an image it loaded from bytes (a data: URL
or a fetched URL): blake3 over a framed stream of the keys ``image`` and ``model_id`` in sorted order, the image
framed as its original encoded bytes, plus the decode settings when its mode was converted to RGB. Every chunk
is preceded by its length (8 bytes, little endian) and every value by a tag, so distinct inputs never share a
stream. Routers and encoder caches that key on vLLM's hashes find ours equal for the same bytes and model."""

from __future__ import annotations

from collections.abc import Iterator

from blake3 import blake3

_TAG_SEQUENCE = b"\x01"
_TAG_MAPPING = b"\x02"
_TAG_LEAF = b"\x03"
_WHITE = (255, 255, 255)


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield len(chunk).to_bytes(8, "little")
    yield chunk


def _int_leaf(value: int) -> Iterator[bytes]:
    yield _TAG_LEAF
    yield from _framed(value.to_bytes(8, "little", signed=True))  # numpy's int64 bytes


def _str_leaf(value: str) -> Iterator[bytes]:
    yield _TAG_LEAF
    yield from _framed(value.encode())


def _image_value(data: bytes, converted: bool) -> Iterator[bytes]:
    yield _TAG_LEAF  # the loaded image, a leaf that serialises itself as one more key/value pair
    yield from _framed(b"image")
    if not converted:
        yield _TAG_LEAF
        yield from _framed(data)
        return
    yield _TAG_MAPPING
    yield (2).to_bytes(8, "little")
    yield from _framed(b"io_config")
    yield _TAG_MAPPING
    yield (2).to_bytes(8, "little")
    yield from _framed(b"image_mode")
    yield from _str_leaf("RGB")
    yield from _framed(b"rgba_background_color")
    yield _TAG_SEQUENCE
    yield (3).to_bytes(8, "little")
    for channel in _WHITE:
        yield from _int_leaf(channel)
    yield from _framed(b"data")
    yield _TAG_LEAF
    yield from _framed(data)


def image_hash(data: bytes, model_id: str, *, converted: bool) -> str:
    """vLLM's mm_hash of an image loaded from ``data`` for ``model_id``; ``converted`` when its decoded mode was
    not plain RGB (vLLM then hashes the conversion settings with the bytes)."""
    hasher = blake3()
    for key, value in (("image", _image_value(data, converted)), ("model_id", _str_leaf(model_id))):
        for chunk in _framed(key.encode()):
            hasher.update(chunk)
        for chunk in value:
            hasher.update(chunk)
    return hasher.hexdigest()


def content_key(data: bytes) -> str:
    """The cache key of an image's bytes (model-independent: a pool serves one model)."""
    return blake3(data).hexdigest()
