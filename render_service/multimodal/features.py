"""vLLM's ``features`` object for a rendered image prompt: ``mm_hashes`` and ``mm_placeholders`` per modality,
``kwargs_data`` and ``mm_metadata`` (each image's item in vLLM's wire encoding, ``wire``) unless the client asked
for ``mm_payload: "none"``, and ``mm_grid_thw``: each image's grid as a plain JSON array, for routers that read
features without msgpack (vLLM's engine ignores the extra key)."""

from __future__ import annotations

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
        "mm_metadata": {"image": [image.metadata_item for image in images]} if tensors else None,
        "mm_grid_thw": {"image": [list(image.grid_thw) for image in images]},
    }
