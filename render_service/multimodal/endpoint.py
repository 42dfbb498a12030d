"""The render endpoints' image path (chat, Responses, Messages): the API's request mapped to chat messages, its
images fetched, bounded and processed in the worker pool (on the event loop only awaited), then the text render
runs in the render queue as for any request, with each image's token expanded and ``features`` attached."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from render_service.http.errors import ApiError
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
    from render_service.http.render_queue import RenderQueue
    from render_service.render.render_config import RenderConfig
    from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest

ExpandPrompt = Callable[[list[int]], list[int]]
# The API's render of a chat request whose image parts are placeholder text: calls render_chat with expand_prompt
RenderWith = Callable[["ChatCompletionRequest", ExpandPrompt], "GenerateRequest"]


def _options(body: bytes) -> MultimodalOptions:
    try:
        return msgspec.json.decode(body, type=MultimodalOptions)
    except msgspec.ValidationError as exc:
        raise ApiError(f"Invalid request: {exc}", 400, "mm_payload") from None


async def render_with_images(body: bytes, chat: ChatCompletionRequest, config: RenderConfig,
                             mm: MultimodalRender | None, queue: RenderQueue, render: RenderWith,
                             endpoint: str = "chat_render") -> GenerateRequest | None:
    """The rendered request with images, or None when ``chat`` carries no image part (the text path serves it).
    ``chat``: the request as chat messages (image parts kept); ``body``: the raw request, for ``mm_payload``."""
    bounds = mm.bounds if mm is not None else ImageBounds()
    placeholder_family = mm.family if mm is not None else _any_family()
    messages, refs = split_images(chat.messages, placeholder_family, bounds)
    if not refs:
        return None
    if mm is None:
        raise UnsupportedModel(describe_model(config.bundle.config))
    tensors = _options(body).tensors
    images = await process_images(refs, mm, tensors)
    features: dict[str, Any] = {}

    def expand(token_ids: list[int]) -> list[int]:
        ids, built = attach(token_ids, images, mm.image_token_id, tensors)
        features.update(built)
        return ids

    def job() -> GenerateRequest:
        result = render(msgspec.structs.replace(chat, messages=messages), expand)
        result.features = features
        return result

    return await queue.run(endpoint, len(body), job)


def _any_family() -> Any:
    family = family_from_configs({"model_type": "qwen2_5_vl"}, {})
    assert family is not None
    return family
