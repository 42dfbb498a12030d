"""The image path of every route that renders a chat-shaped request (the render endpoints, the gateway's chat,
Responses and Messages routes, Messages' count_tokens): the API's request mapped to chat messages, its images
fetched, bounded and processed in the worker pool (on the event loop only awaited), then the text render runs in
the render queue as for any request, with each image's token expanded and ``features`` attached."""

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
from render_service.multimodal.pool import ProcessedImage

if TYPE_CHECKING:
    from render_service.http.render_queue import RenderQueue
    from render_service.render.render_config import RenderConfig
    from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest

ExpandPrompt = Callable[[list[int]], list[int]]
# The API's render of a chat request whose image parts are placeholder text: calls render_chat with expand_prompt
RenderWith = Callable[["ChatCompletionRequest", ExpandPrompt], "GenerateRequest"]


def requested_tensors(body: bytes) -> bool:
    """Whether the request wants the processed tensors (``mm_payload``; a router asks for none)."""
    try:
        options = msgspec.json.decode(body, type=MultimodalOptions)
    except msgspec.ValidationError as exc:
        raise ApiError(f"Invalid request: {exc}", 400, "mm_payload") from None
    if options.mm_processor_kwargs:
        raise ApiError("mm_processor_kwargs are not supported with images: the render tier processes images with "
                       "the model's own processor settings", 400, "mm_processor_kwargs")
    return options.tensors


class PicturedChat:
    """A chat request's images, processed: its messages with each image part as the family's placeholder text,
    and ``expand`` for its rendered ids, which fills ``features`` in."""

    def __init__(self, messages: list[dict[str, Any]], images: list[ProcessedImage], image_token_id: int,
                 tensors: bool, wrap_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> None:
        self.messages = messages
        self.images = images
        self.image_token_id = image_token_id
        self.tensors = tensors
        self.wrap_ids = wrap_ids
        self.features: dict[str, Any] = {}

    def expand(self, token_ids: list[int]) -> list[int]:
        ids, self.features = attach(token_ids, self.images, self.image_token_id, self.tensors, self.wrap_ids)
        return ids


async def picture_chat(chat: ChatCompletionRequest, config: RenderConfig, mm: MultimodalRender | None,
                       want_tensors: Callable[[], bool]) -> PicturedChat | None:
    """``chat``'s images processed, or None when it carries no image part (the text path serves it). A server
    without a covered vision-language model answers an image part with a 400 naming the families covered.
    ``want_tensors``: asked only once the request has images (a text request's ``mm_payload`` is not read)."""
    bounds = mm.bounds if mm is not None else ImageBounds()
    messages, refs = split_images(chat.messages, mm.family if mm is not None else _any_family(), bounds)
    if not refs:
        return None
    if mm is None:
        raise UnsupportedModel(describe_model(config.bundle.config))
    tensors = want_tensors()
    return PicturedChat(messages, await process_images(refs, mm, tensors), mm.image_token_id, tensors, mm.wrap_ids)


async def render_with_images(body: bytes, chat: ChatCompletionRequest, config: RenderConfig,
                             mm: MultimodalRender | None, queue: RenderQueue, render: RenderWith,
                             endpoint: str = "chat_render") -> GenerateRequest | None:
    """The rendered request with images, or None when ``chat`` carries no image part (the text path serves it).
    ``chat``: the request as chat messages (image parts kept); ``body``: the raw request, for ``mm_payload``."""
    pictured = await picture_chat(chat, config, mm, lambda: requested_tensors(body))
    if pictured is None:
        return None

    def job() -> GenerateRequest:
        result = render(msgspec.structs.replace(chat, messages=pictured.messages), pictured.expand)
        result.features = pictured.features
        return result

    return await queue.run(endpoint, len(body), job)


def _any_family() -> Any:
    family = family_from_configs({"model_type": "qwen2_5_vl"}, {})
    assert family is not None
    return family
