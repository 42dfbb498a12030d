"""The Qwen-VL image rule: resize to a grid of patch_size x merge_size cells within [min_pixels, max_pixels],
keeping the aspect ratio; one placeholder token per merge_size x merge_size block of patches. Pixel values are
rescaled, normalised and laid out patch by patch as the model's image processor lays them out."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from render_service.multimodal.bounds import ImageError
from render_service.multimodal.families import VisionFamily

MAX_ASPECT_RATIO = 200  # the processor refuses more


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``factor``, pixels within the bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"an image's aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_thw(height: int, width: int, family: VisionFamily) -> tuple[int, int, int]:
    """(temporal, height, width) in patches for one image."""
    h, w = smart_resize(height, width, family.patch_size * family.merge_size, family.min_pixels, family.max_pixels)
    return 1, h // family.patch_size, w // family.patch_size


def image_token_count(height: int, width: int, family: VisionFamily) -> int:
    t, h, w = grid_thw(height, width, family)
    return t * h * w // (family.merge_size * family.merge_size)


def patches_shape(grid: tuple[int, int, int], family: VisionFamily) -> tuple[int, int]:
    """(rows, patch_dim) of an image's pixel values: one row per patch."""
    t, gh, gw = grid
    return t * gh * gw, 3 * family.temporal_patch_size * family.patch_size * family.patch_size


def pixel_values(image: Image.Image, family: VisionFamily, normalize: bool = True, out: memoryview | None = None
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches x (3 * temporal * patch * patch), grid_thw) for an RGB image: bicubic resize to the grid, then
    (``normalize``) /255 and mean/std as float32, or (not ``normalize``) the resized uint8 pixels as they are, for
    an engine that normalises on its device (vLLM's default, ``mm_device_do_normalize``); each patch repeated over
    the temporal axis, patches ordered merge block by block. ``out``: where to write them (exactly their bytes,
    C order), instead of a new array."""
    grid = grid_thw(image.height, image.width, family)
    _, gh, gw = grid
    p, m, tp = family.patch_size, family.merge_size, family.temporal_patch_size
    resized = image.resize((gw * p, gh * p), Image.Resampling.BICUBIC)
    dtype = np.float32 if normalize else np.uint8
    rows, patch_dim = patches_shape(grid, family)
    values = (np.empty((rows, patch_dim), dtype) if out is None
              else np.frombuffer(out, dtype, rows * patch_dim).reshape(rows, patch_dim))
    # (merge row, merge column, row in block, column in block, channel, temporal, patch row), each element one
    # patch row of ``p`` values as a single opaque item: numpy then copies runs, not values one by one
    run = np.dtype(f"V{p * values.itemsize}")
    target = values.view(run).reshape(gh // m, gw // m, m, m, 3, tp, p)
    patches = values.view(np.dtype(f"V{p * p * values.itemsize}")).reshape(gh // m, -1, 3, tp)
    scale = np.float32(1 / 255)
    planes = []
    # one band at a time (Pillow splits the channels in C): patch rows copied from planes, not every third value
    for channel, band in enumerate(resized.split()):
        plane = np.asarray(band)
        if normalize:  # the same float32 operations as on the whole image, channel by channel
            plane = (plane.astype(np.float32) * scale - np.float32(family.image_mean[channel])) / np.float32(
                family.image_std[channel])
        planes.append(plane.view(run).reshape(gh // m, m, p, gw // m, m).transpose(0, 3, 1, 4, 2))
    # a strip of merge rows at a time (about 1 MB of patches): the temporal copies read what is still in cache
    step = max(1, (1 << 20) // (patches[0].size * patches.itemsize))
    for top in range(0, gh // m, step):
        first = target[top:top + step, :, :, :, :, 0]
        for channel, plane in enumerate(planes):
            first[:, :, :, :, channel] = plane[top:top + step]
        for t in range(1, tp):  # the temporal copies: whole patches
            patches[top:top + step, :, :, t] = patches[top:top + step, :, :, 0]
    return values, grid
