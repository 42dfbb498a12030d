"""Anthropic Messages API wire objects (request, message, content blocks, stream events) as msgspec structs.

Shapes follow Anthropic's API reference and the ``anthropic`` package's types. Requests are lenient (unknown keys
ignored); content blocks stay plain data here and ``messages.py`` checks each one (400 in Anthropic's error shape).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from render_service.extend.protocol import PreviousTurn
from render_service.wire.protocol import GenerateResponse, GenerateStreamResponse


class MessagesRequest(msgspec.Struct, kw_only=True):
    messages: list[Any]
    model: str | None = None
    max_tokens: int | None = None
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None  # vLLM: effort and a json_schema format
    # vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    # ours (docs/rl.md): extend the previous turn's sampled ids; per-token loss masks
    previous_turn: PreviousTurn | None = None
    return_assistant_tokens_mask: bool = False
    return_message_indices: bool = False
    return_prompt_ref: bool = False  # ours: keep the prompt for the next turn's previous_turn.prompt_ref


class CountTokensRequest(msgspec.Struct, kw_only=True):
    messages: list[Any]
    model: str | None = None
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


# ------------------------------------------------------------------------------------------- output


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class OutputTokensDetails(msgspec.Struct):
    thinking_tokens: int  # reasoning tokens and their delimiters, as Anthropic counts them


class MessagesUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    output_tokens_details: OutputTokensDetails | UnsetType = UNSET  # with a reasoning parser, once known


class MessageObject(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    role: str = "assistant"
    content: list[ContentBlock] = []
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


# ------------------------------------------------------------------------------------------- events


class MessageStartEvent(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessageObject


class PingEvent(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class BlockStartEvent(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class BlockDeltaEvent(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class BlockStopEvent(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDeltaBody(msgspec.Struct):
    stop_reason: str | None = None
    stop_sequence: str | None = None


class DeltaUsage(msgspec.Struct):
    output_tokens: int
    output_tokens_details: OutputTokensDetails | UnsetType = UNSET


class MessageDeltaEvent(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: MessageDeltaBody
    usage: DeltaUsage


class MessageStopEvent(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


MessagesStreamEvent = (MessageStartEvent | PingEvent | BlockStartEvent | BlockDeltaEvent | BlockStopEvent
                       | MessageDeltaEvent | MessageStopEvent)


# ------------------------------------------------------------------------------------------- derender


class DerenderMessagesRequest(msgspec.Struct, kw_only=True):
    generate_response: GenerateResponse
    messages_request: MessagesRequest | None = None
    stream: Literal[False] | None = False
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    render_fingerprint: str | None = None


class DerenderMessagesStreamRequest(msgspec.Struct, kw_only=True):
    stream: Literal[True]
    generate_chunk: GenerateStreamResponse
    messages_request: MessagesRequest | None = None
    stream_state: Any = None
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    render_fingerprint: str | None = None


class DerenderMessagesStreamResponse(msgspec.Struct):
    events: list[MessagesStreamEvent]
    stream_state: str | None = None
