"""A chat request with images -> the text render's input and, after it, the engine's: each image part becomes
the family's placeholder text (what the model's chat template writes for an image part), the bytes go to the
worker pool, and the rendered ids get each image's single ``image_token`` expanded to its token count (between
the family's begin and end tokens where it has them: Gemma 4), with
``features`` (hashes, placeholder ranges, tensors unless ``mm_payload`` is "none") in vLLM's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from render_service.http.errors import ApiError, bad_request
from render_service.multimodal.bounds import ImageBounds, ImageError, ImageHeader, check_request_pixels, read_header
from render_service.multimodal.families import Family
from render_service.multimodal.features import build_features
from render_service.multimodal.hashing import content_key
from render_service.multimodal.pool import ImagePool, ProcessedImage
from render_service.multimodal.sources import FetchPolicy, ImageRef, fetch, image_ref


class MultimodalOptions(msgspec.Struct):
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None  # vLLM's deprecated alias: false is mm_payload "none"
    # vLLM applies these per request (Gemma 4's max_soft_tokens, Qwen's min/max_pixels); the render tier renders
    # with the bundle's settings only, so a request that sets any is refused rather than rendered otherwise
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def tensors(self) -> bool:
        if self.mm_payload is not None:
            return self.mm_payload == "tensors"
        return self.return_mm_kwargs is not False


class MultimodalRender(msgspec.Struct):
    """What a server serving a vision-language model needs to render images."""

    family: Family
    image_token_id: int
    model_id: str
    pool: ImagePool
    bounds: ImageBounds = ImageBounds()
    fetch_policy: FetchPolicy = FetchPolicy()
    # float32 normalised pixel values; False (vLLM 0.33's default, mm_device_do_normalize): raw uint8 pixels
    normalize: bool = False
    # ids around each image's run of image tokens (Gemma 4's begin/end of image); the placeholder range covers them
    wrap_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


def split_images(messages: list[dict[str, Any]], family: Family, bounds: ImageBounds
                 ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """``messages`` with every image part replaced by a text part holding the family's placeholder, and the
    images in prompt order. Messages without images are kept as they are."""
    out: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        changed = False
        for at, part in enumerate(content):
            ref = image_ref(part, f"messages[{index}].content[{at}]", bounds) if isinstance(part, Mapping) else None
            if ref is None:
                parts.append(part)
                continue
            refs.append(ref)
            if len(refs) > bounds.max_images:
                raise ImageError(f"a request may carry at most {bounds.max_images} images")
            parts.append({"type": "text", "text": family.placeholder})
            changed = True
        out.append({**message, "content": parts} if changed else message)
    return out, refs


async def process_images(refs: list[ImageRef], mm: MultimodalRender, tensors: bool) -> list[ProcessedImage]:
    """Each image's bytes (fetched where a URL), its header checked against the bounds, then its processing in
    the pool: a 400 for a bad image, a 429 when the pool is full."""
    datas = await asyncio.gather(*(
        fetch(ref, mm.fetch_policy, mm.bounds) if ref.data is None else _ready(ref.data) for ref in refs))
    headers: list[ImageHeader] = [read_header(data, mm.bounds, ref.where) for ref, data in zip(refs, datas)]
    check_request_pixels(headers, mm.bounds)
    keys = [content_key(data) for data in datas]
    mm.pool.admit(len({key for key in keys if not mm.pool.known(key, tensors)}))
    try:
        return list(await asyncio.gather(*(
            mm.pool.process(key, data, header, mm.family, mm.model_id, tensors, mm.normalize)
            for key, data, header in zip(keys, datas, headers))))
    except ApiError:
        raise
    except (ValueError, OSError, MemoryError) as exc:  # a worker's refusal or a broken worker
        raise ImageError(f"an image could not be processed: {type(exc).__name__}: {exc}") from None


async def _ready(data: bytes) -> bytes:
    return data


def expand_placeholders(token_ids: list[int], image_token_id: int, images: list[ProcessedImage],
                        wrap_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
                        ) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids with the k-th ``image_token_id`` repeated ``images[k].num_tokens`` times between ``wrap_ids``, and
    each replacement's (offset, length), wrap included (vLLM's range for such a family: its ``is_embed`` mask
    leaves the wrap out). The template must have written exactly one image token per image."""
    before, after = wrap_ids
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(images):
        raise bad_request(f"the prompt holds {len(positions)} image tokens for {len(images)} images: the chat "
                          "template or the text itself wrote an image token of its own", "messages")
    out: list[int] = []
    ranges: list[tuple[int, int]] = []
    start = 0
    for position, image in zip(positions, images):
        out.extend(token_ids[start:position])
        ranges.append((len(out), len(before) + image.num_tokens + len(after)))
        out.extend(before)
        out.extend([image_token_id] * image.num_tokens)
        out.extend(after)
        start = position + 1
    out.extend(token_ids[start:])
    return out, ranges


def attach(token_ids: list[int], images: list[ProcessedImage], image_token_id: int, tensors: bool,
           wrap_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> tuple[list[int], dict[str, Any]]:
    ids, ranges = expand_placeholders(list(token_ids), image_token_id, images, wrap_ids)
    return ids, build_features(images, ranges, tensors)
