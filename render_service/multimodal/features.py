"""vLLM's ``features`` object for a rendered image prompt: ``mm_hashes`` and ``mm_placeholders`` per modality,
``kwargs_data`` (the processed tensors, base64) unless the client asked for ``mm_payload: "none"``, and
``mm_metadata`` with each image's grid as a plain JSON array (what routers read without PyTorch)."""

from __future__ import annotations

import base64
from typing import Any

from render_service.multimodal.pool import ProcessedImage


def build_features(images: list[ProcessedImage], ranges: list[tuple[int, int]], tensors: bool) -> dict[str, Any]:
    features: dict[str, Any] = {
        "mm_hashes": {"image": [image.mm_hash for image in images]},
        "mm_placeholders": {"image": [{"offset": offset, "length": length} for offset, length in ranges]},
        "kwargs_data": None,
        "mm_metadata": {"image": [{"image_grid_thw": list(image.grid_thw)} for image in images]},
    }
    if tensors:
        features["kwargs_data"] = {"image": [encode_pixel_values(image) for image in images]}
    return features


def encode_pixel_values(image: ProcessedImage) -> str | None:
    if image.pixel_values is None:
        return None
    return base64.b64encode(image.pixel_values).decode("ascii")
