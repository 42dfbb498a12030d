"""Which vision-language families the render tier counts image placeholders for, read from a model's
config.json and preprocessor_config.json. Families not listed are refused with a 400 naming those covered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from render_service.http.errors import ApiError

# config.json model_type -> family name; every one resizes to a patch grid (``qwen_vl``).
_QWEN_VL_TYPES = {
    "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_vl_moe": "Qwen3-VL",
}
SUPPORTED = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL (model_type " + ", ".join(sorted(_QWEN_VL_TYPES)) + ")"
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class VisionFamily(msgspec.Struct, frozen=True):
    """A patch-grid image processor and how the chat template marks an image."""

    name: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    @property
    def placeholder(self) -> str:
        """What the chat template writes for one image; ``image_token`` is then repeated per merged patch."""
        return self.vision_start + self.image_token + self.vision_end


class UnsupportedModel(ApiError):
    def __init__(self, detail: str) -> None:
        super().__init__(f"Images are not supported for this model ({detail}); the render tier covers {SUPPORTED}.",
                         400, "messages")


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return value if isinstance(value, dict) else {}


def family_from_configs(config: dict[str, Any], preprocessor: dict[str, Any]) -> VisionFamily | None:
    """The family of a model from its configs; None when it is not a covered vision-language model."""
    model_type = str(config.get("model_type", ""))
    name = _QWEN_VL_TYPES.get(model_type)
    if name is None:
        return None
    qwen3 = model_type.startswith("qwen3")
    vision = config.get("vision_config") or {}
    patch = int(preprocessor.get("patch_size") or vision.get("patch_size") or (16 if qwen3 else 14))
    merge = int(preprocessor.get("merge_size") or vision.get("spatial_merge_size") or 2)
    temporal = int(preprocessor.get("temporal_patch_size") or vision.get("temporal_patch_size") or 2)
    size = preprocessor.get("size") or {}
    min_pixels = int(preprocessor.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    max_pixels = int(preprocessor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    default_mean, default_std = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)) if qwen3 else (_CLIP_MEAN, _CLIP_STD)
    mean = tuple(float(x) for x in preprocessor.get("image_mean") or default_mean)
    std = tuple(float(x) for x in preprocessor.get("image_std") or default_std)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError("preprocessor_config.json: image_mean and image_std must have 3 values")
    return VisionFamily(name, patch, merge, temporal, min_pixels, max_pixels,
                        (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


def family_from_bundle(model_dir: str | Path) -> VisionFamily | None:
    path = Path(model_dir)
    return family_from_configs(_read(path / "config.json"), _read(path / "preprocessor_config.json"))


def describe_model(config: dict[str, Any]) -> str:
    return f"model_type {config.get('model_type')!r}" if config.get("model_type") else "a text-only bundle"
