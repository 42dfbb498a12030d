"""Images on the gateway's routes: the render endpoints' image path (multimodal.endpoint), asked for what an
engine needs. The engine gets the expanded ids and ``features`` with the processed tensors, so a client's
``mm_payload: "none"`` (a router's render option: no tensors) is a 400 here, as vLLM's generate refuses it."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

from render_service.http.errors import bad_request
from render_service.http.request_io import server_state
from render_service.multimodal.endpoint import PicturedChat, picture_chat, requested_tensors
from render_service.render.prerendered import RENDER_KEYS
from render_service.render.render_config import RenderConfig
from render_service.wire.message_memo import carries_image_parts
from render_service.wire.protocol import ChatCompletionRequest, GenerateRequest


def engine_tensors(body: bytes) -> bool:
    if not requested_tensors(body):
        raise bad_request('mm_payload "none" renders for routers (no tensors); the gateway sends the engine the '
                          "processed images, so it takes the default (tensors)", "mm_payload")
    return True


async def picture(request: Request, body: bytes, chat: ChatCompletionRequest, config: RenderConfig
                  ) -> PicturedChat | None:
    """``chat``'s images processed with their tensors, or None when it carries none. A prompt rendered already
    (``kv_transfer_params.prompt_token_ids``) has no features to go with it: with images it is a 400."""
    if chat.kv_transfer_params and set(chat.kv_transfer_params) & RENDER_KEYS \
            and carries_image_parts(chat.messages):
        raise bad_request("a prompt rendered already (kv_transfer_params.prompt_token_ids) cannot carry images: "
                          "send the request's messages alone", "kv_transfer_params")
    return await picture_chat(chat, config, server_state(request).multimodal, lambda: engine_tensors(body))


def prepared(chat: ChatCompletionRequest, pictured: PicturedChat) -> ChatCompletionRequest:
    """``chat`` as the text render reads it: each image part is the family's placeholder text."""
    return msgspec.structs.replace(chat, messages=pictured.messages)


def with_features(gen: GenerateRequest, pictured: PicturedChat) -> GenerateRequest:
    """The rendered request with its images' ``features`` (filled in by ``pictured.expand`` during the render)."""
    return msgspec.structs.replace(gen, features=pictured.features)
