"""Which vision-language families the render tier counts image placeholders for, read from a model's
config.json and preprocessor_config.json (or processor_config.json's ``image_processor``). Two rules: a patch grid
(Qwen-VL, ``VisionFamily``) and a soft-token budget (Gemma 4, ``BudgetFamily``). Families not listed are refused
with a 400 naming those covered."""

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
SUPPORTED = ("Qwen2-VL, Qwen2.5-VL, Qwen3-VL (model_type " + ", ".join(sorted(_QWEN_VL_TYPES)) + ") and Gemma 4 "
             "(model_type gemma4 with a vision_config); not Gemma 3, Gemma 3n or other families")
# The budgets (soft tokens per image) Gemma 4's image processor and vLLM's Gemma 4 model accept.
GEMMA4_BUDGETS = (70, 140, 280, 560, 1120)
# vLLM casts a processor's float tensors to the model's dtype; "auto" turns a float32 checkpoint into bfloat16
# on the GPUs it serves Gemma 4 on.
_PIXEL_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "bfloat16"}
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


class BudgetFamily(msgspec.Struct, frozen=True):
    """Gemma 4's rule: resize keeping the aspect ratio to the largest multiples of ``patch_size`` x
    ``pooling_kernel_size`` within ``max_soft_tokens`` x kernel x kernel patches; one soft token per kernel x kernel
    patches. The template writes ``image_token`` once per image; it becomes ``boi`` + soft tokens + ``eoi``."""

    name: str
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    rescale_factor: float
    pixel_dtype: str  # the dtype vLLM sends pixel values in: the model's
    image_mean: tuple[float, float, float] | None = None  # None: no normalisation (Gemma 4's default)
    image_std: tuple[float, float, float] | None = None
    image_token: str = "<|image|>"
    boi_token: str = "<|image>"
    eoi_token: str = "<image|>"

    @property
    def placeholder(self) -> str:
        return self.image_token

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2


Family = VisionFamily | BudgetFamily


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


def family_from_configs(config: dict[str, Any], preprocessor: dict[str, Any]) -> Family | None:
    """The family of a model from its configs; None when it is not a covered vision-language model."""
    model_type = str(config.get("model_type", ""))
    if model_type == "gemma4":
        return gemma4_family(config, preprocessor) if config.get("vision_config") else None
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


def gemma4_family(config: dict[str, Any], preprocessor: dict[str, Any]) -> BudgetFamily:
    """Gemma 4 from its configs. vLLM counts placeholders with the vision config's ``default_output_length``
    and transformers' processor makes pixel values with its ``max_soft_tokens``: a bundle where they differ
    gets prompts vLLM's own model refuses, so it is refused here."""
    vision = config.get("vision_config") or {}
    budget = int(preprocessor.get("max_soft_tokens") or 280)
    default = int(vision.get("default_output_length") or budget)
    if budget not in GEMMA4_BUDGETS or default != budget:
        raise ValueError(f"Gemma 4: max_soft_tokens {budget} (image processor) and default_output_length "
                         f"{default} (vision_config) must agree and be one of {GEMMA4_BUDGETS}")
    patch, kernel = (_agreed(preprocessor, vision, key, default)  # (vLLM counts with the vision config's)
                     for key, default in (("patch_size", 16), ("pooling_kernel_size", 3)))
    if preprocessor.get("do_resize") is False or preprocessor.get("do_rescale") is False:
        raise ValueError("Gemma 4: only the processor's resize and rescale (its defaults) are covered")
    if preprocessor.get("resample") not in (None, 3):  # 3: PIL's BICUBIC, the processor's default
        raise ValueError("Gemma 4: only bicubic resampling (the processor's default) is covered")
    mean = std = None
    if preprocessor.get("do_normalize"):
        mean_in = [float(x) for x in preprocessor.get("image_mean") or (0.0, 0.0, 0.0)]
        std_in = [float(x) for x in preprocessor.get("image_std") or (1.0, 1.0, 1.0)]
        if len(mean_in) != 3 or len(std_in) != 3:
            raise ValueError("Gemma 4: image_mean and image_std must have 3 values")
        mean, std = (mean_in[0], mean_in[1], mean_in[2]), (std_in[0], std_in[1], std_in[2])
    dtype = str(config.get("dtype") or config.get("torch_dtype")
                or (config.get("text_config") or {}).get("dtype") or "bfloat16")
    return BudgetFamily("Gemma 4", patch, kernel, budget, float(preprocessor.get("rescale_factor") or 1 / 255),
                        _PIXEL_DTYPES.get(dtype, "bfloat16"), mean, std)


def _agreed(preprocessor: dict[str, Any], vision: dict[str, Any], key: str, default: int) -> int:
    values = {int(source[key]) for source in (preprocessor, vision) if source.get(key)}
    if len(values) > 1:
        raise ValueError(f"Gemma 4: {key} differs between the image processor and vision_config: {sorted(values)}")
    return values.pop() if values else default


def _image_processor_settings(path: Path) -> dict[str, Any]:
    """preprocessor_config.json, or the ``image_processor`` of processor_config.json (transformers 5 writes
    a processor's settings there)."""
    settings = _read(path / "preprocessor_config.json")
    if settings:
        return settings
    nested = _read(path / "processor_config.json").get("image_processor")
    return nested if isinstance(nested, dict) else {}


def family_from_bundle(model_dir: str | Path) -> Family | None:
    path = Path(model_dir)
    return family_from_configs(_read(path / "config.json"), _image_processor_settings(path))


def describe_model(config: dict[str, Any]) -> str:
    return f"model_type {config.get('model_type')!r}" if config.get("model_type") else "a text-only bundle"
