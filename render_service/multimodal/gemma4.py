"""Gemma 4's image rule: resize keeping the aspect ratio to the largest sides that are multiples of patch x
kernel within the budget's patches (transformers' ``get_aspect_ratio_preserving_size``), one soft token per
kernel x kernel patches. Pixel values are rescaled (and normalised where the processor is set to), cut into
patches of (row, column, channel) values, padded with zeros to the budget's patches, with each patch's (x, y)
position (-1 for padding), in the dtype vLLM sends them in."""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image

from render_service.multimodal.bounds import ImageError
from render_service.multimodal.families import BudgetFamily
from render_service.multimodal.wire import ItemLayout, budget_item_layout


def target_size(height: int, width: int, family: BudgetFamily) -> tuple[int, int]:
    """(height, width) the processor resizes to: transformers' rule, its edge cases included."""
    patch, kernel, max_patches = family.patch_size, family.pooling_kernel_size, family.max_patches
    target_px = max_patches * patch ** 2
    factor = math.sqrt(target_px / (height * width))
    side = kernel * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // kernel ** 2) * side
    if h == 0:  # (both cannot be: the budget is far above one cell)
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def _vllm_count(height: int, width: int, family: BudgetFamily) -> int:
    """The soft tokens vLLM 0.33's Gemma 4 model puts in the prompt (``_compute_num_soft_tokens``): the same rule
    written another way, which can round differently at an exact multiple."""
    patch, kernel = family.patch_size, family.pooling_kernel_size
    unit = patch * kernel
    scale = math.sqrt(family.max_patches / ((height / patch) * (width / patch)))
    h = max(unit, int(math.floor(height * scale / unit)) * unit)
    w = max(unit, int(math.floor(width * scale / unit)) * unit)
    return min((h // patch) * (w // patch) // kernel ** 2, family.max_soft_tokens)


def soft_token_count(height: int, width: int, family: BudgetFamily) -> int:
    """The image's soft tokens; a 400 for a size where vLLM's count and the processor's output would disagree
    (vLLM's model refuses such a prompt)."""
    h, w = target_size(height, width, family)
    count = (h // family.patch_size) * (w // family.patch_size) // family.pooling_kernel_size ** 2
    if count != _vllm_count(height, width, family):
        raise ImageError(f"an image of {width}x{height} pixels gets {count} soft tokens from {family.name}'s "
                         f"processor but {_vllm_count(height, width, family)} from vLLM's prompt: resize it")
    return count


def patch_dim(family: BudgetFamily) -> int:
    return 3 * family.patch_size ** 2


def _positions(h: int, w: int, family: BudgetFamily) -> bytes:
    """int64 (x, y) of each patch, rows first, then (-1, -1) up to the budget's patches."""
    rows, cols = h // family.patch_size, w // family.patch_size
    positions = np.full((family.max_patches, 2), -1, dtype="<i8")
    positions[:rows * cols, 0] = np.tile(np.arange(cols), rows)
    positions[:rows * cols, 1] = np.repeat(np.arange(rows), cols)
    return positions.tobytes()


def item_layout(height: int, width: int, family: BudgetFamily) -> ItemLayout:
    h, w = target_size(height, width, family)
    return budget_item_layout(family.pixel_dtype, family.max_patches, patch_dim(family), _positions(h, w, family))


@functools.lru_cache(maxsize=8)
def _values_table(family: BudgetFamily) -> np.ndarray:
    """(3, 256): each channel's output value for each byte, computed as the processor computes it (float64
    rescale cast to float32, then float32 normalisation), then rounded to the output dtype as torch rounds
    (to nearest, ties to even). As unsigned integers of the output's width: written bytes, not numbers."""
    scaled = (np.arange(256, dtype=np.float64) * family.rescale_factor).astype(np.float32)
    table = np.stack([scaled] * 3)
    if family.image_mean is not None and family.image_std is not None:
        mean = np.asarray(family.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(family.image_std, dtype=np.float32)[:, None]
        table = (table - mean) / std
    if family.pixel_dtype == "float32":
        return table.view(np.uint32)
    if family.pixel_dtype == "float16":
        return table.astype(np.float16).view(np.uint16)
    bits = table.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # bfloat16 (finite values)


def pixel_values(image: Image.Image, family: BudgetFamily, out: memoryview | None = None) -> np.ndarray:
    """(budget's patches, 3 * patch * patch) pixel values of an RGB image, as unsigned integers of the output
    dtype's width (their bytes are the values'); ``out``: where to write them instead of a new array."""
    h, w = target_size(image.height, image.width, family)
    resized = image if (image.width, image.height) == (w, h) else image.resize((w, h), Image.Resampling.BICUBIC)
    table = _values_table(family)
    p, dim = family.patch_size, patch_dim(family)
    values = (np.empty((family.max_patches, dim), table.dtype) if out is None
              else np.frombuffer(out, table.dtype, family.max_patches * dim).reshape(family.max_patches, dim))
    count = (h // p) * (w // p)
    pixels = np.asarray(resized).reshape(h // p, p, w // p, p, 3).transpose(0, 2, 1, 3, 4)
    target = values[:count].reshape(h // p, w // p, p, p, 3)
    for channel in range(3):
        target[..., channel] = table[channel][pixels[..., channel]]
    values[count:] = 0
    return values
