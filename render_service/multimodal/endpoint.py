"""The chat render endpoint's image path: a body that may carry images is decoded, its images fetched, bounded
and processed in the worker pool (on the event loop only awaited), then the text render runs in the render
queue as for any chat request, with each image's token expanded and ``features`` attached."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from render_service.errors import ApiError
from render_service.multimodal.bounds import ImageBounds
from render_service.multimodal.chat import (
    MultimodalOptions,
    MultimodalRender,
    attach,
    process_images,
    split_images,
)
from render_service.multimodal.families import UnsupportedModel, describe_model, family_from_configs

if TYPE_CHECKING:
    from render_service.protocol import ChatCompletionRequest, GenerateRequest
    from render_service.render_config import RenderConfig
    from render_service.render_queue import RenderQueue


def _options(body: bytes) -> MultimodalOptions:
    try:
        return msgspec.json.decode(body, type=MultimodalOptions)
    except msgspec.ValidationError as exc:
        raise ApiError(f"Invalid request: {exc}", 400, "mm_payload") from None


async def render_image_chat(
    body: bytes, req: ChatCompletionRequest, config: RenderConfig, mm: MultimodalRender | None, queue: RenderQueue,
    render: Callable[..., GenerateRequest], request_id: str | None,
) -> GenerateRequest | None:
    """The rendered request with images, or None when ``req`` carries no image part (the text path serves it).
    ``render`` is the text render (``render.render_chat``), called with ``expand_prompt``."""
    bounds = mm.bounds if mm is not None else ImageBounds()
    placeholder_family = mm.family if mm is not None else _any_family()
    messages, refs = split_images(req.messages, placeholder_family, bounds)
    if not refs:
        return None
    if mm is None:
        raise UnsupportedModel(describe_model(config.bundle.config))
    tensors = _options(body).mm_payload == "tensors"
    images = await process_images(refs, mm, tensors)
    features: dict[str, Any] = {}

    def expand(token_ids: list[int]) -> list[int]:
        ids, built = attach(token_ids, images, mm.image_token_id, tensors)
        features.update(built)
        return ids

    def job() -> GenerateRequest:
        result = render(msgspec.structs.replace(req, messages=messages), config, request_id=request_id,
                        expand_prompt=expand)
        result.features = features
        return result

    return await queue.run("chat_render", len(body), job)


def _any_family() -> Any:
    family = family_from_configs({"model_type": "qwen2_5_vl"}, {})
    assert family is not None
    return family
