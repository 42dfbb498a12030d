"""Blocks -> Anthropic Messages output: content blocks for a whole message, and the stream's event sequence.

A reasoning block is a ``thinking`` block, a text block a ``text`` block, a call block a ``tool_use`` block whose
``id`` is the pipeline's tool-call id and whose ``input`` is the parsed arguments. Thinking signatures are
derived from the message id and block index (we verify none on input: nothing here can check Anthropic's).

The stream: ``message_start``, ``ping``, per block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``), a ``signature_delta`` before a thinking block stops, ``content_block_stop``;
then ``message_delta`` (stop_reason, stop_sequence, output tokens) and ``message_stop``. No event repeats earlier
text, so a Messages stream state is constant-size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from msgspec import UNSET, UnsetType

from render_service.apis.messages_protocol import (
    BlockDeltaEvent,
    BlockStartEvent,
    BlockStopEvent,
    ContentBlock,
    DeltaUsage,
    InputJsonDelta,
    MessageDeltaBody,
    MessageDeltaEvent,
    MessageObject,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    OutputTokensDetails,
    PingEvent,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from render_service.apis.segments import BlockInfo, BlockState, BlockTexts, Step, parse_arguments


def signature(message_id: str, block: int) -> str:
    return hashlib.blake2b(f"{message_id}\x00{block}".encode(), digest_size=24).hexdigest()


def stop_reason(finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the pipeline's finish reason and the engine's / gateway's stop reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessagesShape:
    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens

    def block(self, index: int, info: BlockInfo, text: str) -> ContentBlock:
        if info.kind == "reasoning":
            return ThinkingBlock(text, signature(self.message_id, index))
        if info.kind == "text":
            return TextBlock(text)
        return ToolUseBlock(info.call_id, info.name, parse_arguments(text))

    def message(self, blocks: BlockState, texts: BlockTexts, finish_reason: str | None, stop: Any,
                output_tokens: int, thinking_tokens: int | None = None) -> MessageObject:
        reason, sequence = stop_reason(finish_reason, stop)
        return MessageObject(
            id=self.message_id, model=self.model,
            content=[self.block(i, info, texts.text(i)) for i, info in enumerate(blocks.blocks)],
            stop_reason=reason, stop_sequence=sequence,
            usage=MessagesUsage(input_tokens=self.prompt_tokens, output_tokens=output_tokens,
                                output_tokens_details=_details(thinking_tokens)),
        )

    def start_events(self) -> list[Any]:
        start = MessageObject(id=self.message_id, model=self.model, content=[],
                              usage=MessagesUsage(input_tokens=self.prompt_tokens, output_tokens=0))
        return [MessageStartEvent(start), PingEvent()]

    def step_events(self, steps: Sequence[Step], blocks: BlockState) -> list[Any]:
        out: list[Any] = []
        for step in steps:
            info = blocks.blocks[step.block]
            if step.op == "delta":
                out.append(BlockDeltaEvent(step.block, _delta(info.kind, step.text)))
            elif step.op == "open":
                if info.kind == "reasoning":
                    block: ContentBlock = ThinkingBlock("", "")
                elif info.kind == "text":
                    block = TextBlock("")
                else:
                    block = ToolUseBlock(info.call_id, info.name, {})
                out.append(BlockStartEvent(step.block, block))
            else:
                if info.kind == "reasoning":
                    out.append(BlockDeltaEvent(step.block, SignatureDelta(signature(self.message_id, step.block))))
                out.append(BlockStopEvent(step.block))
        return out

    @staticmethod
    def end_events(finish_reason: str | None, stop: Any, output_tokens: int, thinking_tokens: int | None = None
                   ) -> list[Any]:
        reason, sequence = stop_reason(finish_reason, stop)
        usage = DeltaUsage(output_tokens, _details(thinking_tokens))
        return [MessageDeltaEvent(MessageDeltaBody(reason, sequence), usage), MessageStopEvent()]


def _details(thinking_tokens: int | None) -> OutputTokensDetails | UnsetType:
    """Anthropic's ``output_tokens_details`` (thinking tokens), given when a reasoning parser counts them."""
    return UNSET if thinking_tokens is None else OutputTokensDetails(thinking_tokens)


def _delta(kind: str, text: str) -> TextDelta | ThinkingDelta | InputJsonDelta:
    if kind == "text":
        return TextDelta(text)
    if kind == "reasoning":
        return ThinkingDelta(text)
    return InputJsonDelta(text)
