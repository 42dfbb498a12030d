"""vLLM's ``features`` object for a rendered image prompt: ``mm_hashes`` and ``mm_placeholders`` per modality,
``kwargs_data`` and ``mm_metadata`` (each image's item in vLLM's wire encoding, ``wire``) unless the client asked
for ``mm_payload: "none"``, and for a patch-grid family ``mm_grid_thw``: each image's grid as a plain JSON array,
for routers that read features without msgpack (vLLM's engine ignores the extra key)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from render_service.multimodal.pool import ProcessedImage


def build_features(images: list[ProcessedImage], ranges: list[tuple[int, int]], tensors: bool) -> dict[str, Any]:
    return {
        "mm_hashes": {"image": [image.mm_hash for image in images]},
        "mm_placeholders": {"image": [{"offset": offset, "length": length} for offset, length in ranges]},
        # each item already a JSON string (wire.kwargs_item): embedded as it is
        "kwargs_data": {"image": [None if image.kwargs_item is None else msgspec.Raw(image.kwargs_item)
                                  for image in images]} if tensors else None,
        # (vLLM sends none where no field is kept on the CPU: Gemma 4)
        "mm_metadata": {"image": [image.metadata_item for image in images]}
        if tensors and any(image.metadata_item is not None for image in images) else None,
        **({"mm_grid_thw": {"image": [list(image.grid_thw) for image in images if image.grid_thw is not None]}}
           if all(image.grid_thw is not None for image in images) else {}),
    }


# Where an item goes in an answer encoded without it: a JSON encoder never writes a raw NUL, so the hole cannot
# occur anywhere else in the answer.
_HOLE = b'"\x00item\x00"'


def answer_pieces(answer: Any, encode: Callable[[Any], bytes]) -> list[bytes | memoryview]:
    """``answer`` (a rendered request whose ``features`` carry items) as JSON in pieces: the answer encoded with
    a small hole for each item, and the items as they are, in order; joined, exactly ``encode(answer)``. The
    items (17 MB each at 1080p) are written to the socket as the cache holds them, never copied into one body."""
    features: dict[str, Any] | None = answer.features
    kwargs: dict[str, Any] = (features or {}).get("kwargs_data") or {}
    items = [item for item in kwargs.get("image", []) if item is not None]
    if features is None or not items:
        return [encode(answer)]
    holed = {**features, "kwargs_data": {**kwargs, "image": [
        None if item is None else msgspec.Raw(_HOLE) for item in kwargs["image"]]}}
    parts = encode(msgspec.structs.replace(answer, features=holed)).split(_HOLE)
    pieces: list[bytes | memoryview] = [parts[0]]
    for item, part in zip(items, parts[1:], strict=True):
        pieces += (memoryview(item), part)  # (a view of the cached item: no copy)
    return pieces
