"""The contract every parser stage follows.

A stage is configured once per request and then fed text; everything it must remember between
chunks lives in a small msgspec ``State`` struct (plain data: ints, short strings, lists), so the
pipeline can be serialized into ``stream_state``, compared in tests and restored on any replica.
Stages never look at the accumulated history: work per call is proportional to the new text plus
whatever short suffix the state holds back (a possibly-partial tag, an unfinished JSON value).

State ownership: ``feed`` and ``finish`` MUTATE the state they are given in place (no copies on the hot
path, one allocation per request); a caller that needs the old state keeps a copy
(``msgspec.structs.replace`` or an encode/decode round trip). States must hold only plain data so that
``msgspec.msgpack.encode(state)`` / ``msgspec.convert(obj, Parser.State)`` round-trip them exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol

import msgspec


class TextPiece(msgspec.Struct, frozen=True):
    """A run of output text routed to one OpenAI field."""

    channel: Literal["reasoning", "content"]
    text: str


class ToolCallPiece(msgspec.Struct, frozen=True):
    """One streamed fragment of tool call ``index``.

    ``name`` is set exactly once per call (its first fragment); ``arguments`` fragments concatenate to
    the call's JSON arguments. ``id`` is set only when the model's own format carries one (Kimi K2);
    otherwise the pipeline mints a deterministic id.
    """

    index: int
    name: str | None = None
    arguments: str | None = None
    id: str | None = None


Piece = TextPiece | ToolCallPiece


class ToolSpec(msgspec.Struct, frozen=True):
    """What a tool parser may need to know about one declared tool."""

    name: str
    parameters: dict[str, Any] | None = None


class ToolParserConfig(msgspec.Struct, frozen=True):
    tools: list[ToolSpec] = []


class ReasoningParserConfig(msgspec.Struct, frozen=True):
    # False when the prompt already closed reasoning (e.g. enable_thinking=False wrote "<think>\n\n</think>")
    # or when the chat template turned thinking off: then every output character is content.
    reasoning_open_at_start: bool = True
    enable_thinking: bool = True


class ReasoningParser(Protocol):
    """Splits detokenized text into reasoning and content."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: ReasoningParserConfig) -> None: ...

    def initial_state(self) -> msgspec.Struct: ...

    def feed(self, state: Any, text: str) -> list[TextPiece]:
        """Consume new text; may hold back a suffix that could start a tag."""

    def finish(self, state: Any) -> list[TextPiece]:
        """End of output: release anything held back."""


class ToolParser(Protocol):
    """Splits content text into plain content and tool-call fragments."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: ToolParserConfig) -> None: ...

    def initial_state(self) -> msgspec.Struct: ...

    def feed(self, state: Any, text: str) -> list[Piece]:
        """Consume new content text (reasoning never reaches a tool parser)."""

    def finish(self, state: Any) -> list[Piece]:
        """End of output: flush buffered argument text and any held-back content."""
