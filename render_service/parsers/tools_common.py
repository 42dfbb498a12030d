"""Shared machinery for the tool-call parsers: piece collection, state field checks, the held-text base class.

Tag search lives in ``tags``, JSON scanning in ``json_scan``, the JSON call object in ``call_object`` and the
marker-framed formats in ``tools_sectioned``.

Every parser here works the same way: ``feed`` prepends the state's held-back suffix to the new text, walks
the result once from left to right, and stores back only what it cannot decide yet (a possible partial tag,
an incomplete escape, a short name). Nothing ever looks at text that was already consumed, so the work per
feed is O(new text + held-back suffix) however long a call's arguments grow.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from render_service.parsers.base import Piece, TextPiece, ToolCallPiece, ToolParserConfig, ToolSpec

WHITESPACE = " \t\r\n"

# Names are short; a "name" that keeps growing without its terminator is not a name.
MAX_NAME_CHARS = 256

# State fields arrive from clients (stream_state): counters and modes are range-checked on decode.
Count = Annotated[int, msgspec.Meta(ge=0)]


def require(condition: bool, what: str) -> None:
    """Cross-field checks in a state's __post_init__ (msgspec reports them as ValidationError)."""
    if not condition:
        raise ValueError(f"inconsistent tool parser state: {what}")


class PieceSink:
    """Collects pieces, merging adjacent content runs and adjacent argument fragments of one call."""

    __slots__ = ("pieces",)

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def content(self, text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, TextPiece):
            self.pieces[-1] = TextPiece(channel="content", text=last.text + text)
        else:
            self.pieces.append(TextPiece(channel="content", text=text))

    def name(self, index: int, name: str, call_id: str | None = None) -> None:
        self.pieces.append(ToolCallPiece(index=index, name=name, id=call_id))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, ToolCallPiece) and last.index == index:
            merged = (last.arguments or "") + text
            self.pieces[-1] = msgspec.structs.replace(last, arguments=merged)
        else:
            self.pieces.append(ToolCallPiece(index=index, arguments=text))


def tools_by_name(tools: list[ToolSpec]) -> dict[str, ToolSpec]:
    return {t.name: t for t in tools}


class HeldTextToolParser:
    """Base for the parsers here: ``feed`` prepends the held-back suffix and hands the text to ``_run``."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: ToolParserConfig) -> None:
        self.config = config

    def initial_state(self) -> msgspec.Struct:
        return self.State()

    def feed(self, state: Any, text: str) -> list[Piece]:
        sink = PieceSink()
        buf = state.held + text
        state.held = ""
        self._run(state, buf, sink)
        return sink.pieces

    def _run(self, state: Any, buf: str, sink: PieceSink) -> None:
        """Walk ``buf`` once, emitting into ``sink`` and holding back in ``state`` what is not decided yet."""
        raise NotImplementedError
