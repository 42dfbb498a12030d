"""Calls inside a family's own markers, read by an inner parser: ``START`` calls ``END`` (``END`` None: the
calls run to the end of the output). Outside the markers everything is content; inside, the inner parser
(pythonic calls, a JSON list of calls, one JSON call object) reads the block as if it were a whole output, and
its call indexes continue across blocks. A family of this shape is a declaration:

    class Lfm2ToolParser(WrappedToolParser):
        name = "lfm2"
        START, END, INNER = "<|tool_call_start|>", "<|tool_call_end|>", PythonicToolParser

The markers are markup; what the inner parser does not read as calls is content (its rules: nothing lost).
Work per feed is O(new text + a partial marker) plus the inner parser's own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from render_service.parsers.base import Piece, TextPiece, ToolParserConfig
from render_service.parsers.tags import find_tag
from render_service.parsers.tools_common import Count, PieceSink, require


class WrappedState(msgspec.Struct, omit_defaults=True):
    inside: bool = False
    held: str = ""  # a possible partial marker
    calls: Count = 0  # calls finished in earlier blocks: the index offset of this block's calls
    block_calls: Count = 0  # calls the current block has started
    inner: Any = None  # the inner parser's state while inside a block

    def __post_init__(self) -> None:
        require(len(self.held) <= 256, "held text within bounds")
        require(self.inside or self.inner is None, "an inner state only inside a block")


class WrappedToolParser:
    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]] = WrappedState
    START: ClassVar[str]
    END: ClassVar[str | None]
    INNER: ClassVar[Any]  # the inner parser's class (a ToolParser)
    OTHER_STARTS: ClassVar[tuple[str, ...]] = ()  # other spellings of START
    # END None: the block runs to the end of the output, or (True here) to the next START, which opens the next
    START_ENDS_BLOCK: ClassVar[bool] = False
    # markers dropped outside the blocks (Inkling's <|end_message|> also ends its text and thinking blocks)
    OUTSIDE_DROPPED: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ToolParserConfig) -> None:
        self.config = config
        self.inner = self.INNER(config)
        self._starts = (self.START, *self.OTHER_STARTS)
        self._outside = self._starts + self.OUTSIDE_DROPPED

    def initial_state(self) -> WrappedState:
        return WrappedState()

    def _inner_state(self, state: WrappedState) -> Any:
        if not isinstance(state.inner, self.inner.State):  # decoded from stream_state as plain data
            state.inner = msgspec.convert(state.inner, self.inner.State)
        return state.inner

    def _shifted(self, state: WrappedState, pieces: list[Piece], sink: PieceSink) -> None:
        for p in pieces:
            if isinstance(p, TextPiece):
                sink.content(p.text)
            else:
                state.block_calls = max(state.block_calls, p.index + 1)
                sink.pieces.append(msgspec.structs.replace(p, index=p.index + state.calls))

    def feed(self, state: WrappedState, text: str) -> list[Piece]:
        sink = PieceSink()
        buf = state.held + text if state.held else text
        state.held = ""
        pos, n = 0, len(buf)
        while pos < n:
            if not state.inside:
                at, tag = find_tag(buf, pos, self._outside)
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    break
                pos = at + len(tag)
                if tag in self.OUTSIDE_DROPPED:
                    continue
                state.inside = True
                state.block_calls = 0
                state.inner = self.inner.initial_state()
                continue
            inner = self._inner_state(state)
            if self.END is None and not self.START_ENDS_BLOCK:
                self._shifted(state, self.inner.feed(inner, buf[pos:]), sink)
                break
            at, tag = find_tag(buf, pos, self._starts if self.END is None else (self.END,))
            if buf[pos:at]:
                self._shifted(state, self.inner.feed(inner, buf[pos:at]), sink)
            if tag is None:
                state.held = buf[at:]
                break
            self._end_block(state, sink)
            pos = at if self.END is None else at + len(tag)  # a START that ends a block opens the next
        return sink.pieces

    def _end_block(self, state: WrappedState, sink: PieceSink) -> None:
        self._shifted(state, self.inner.finish(self._inner_state(state)), sink)
        state.calls += state.block_calls
        state.block_calls = 0
        state.inside = False
        state.inner = None

    def finish(self, state: WrappedState) -> list[Piece]:
        sink = PieceSink()
        held, state.held = state.held, ""
        if state.inside:
            if held:
                self._shifted(state, self.inner.feed(self._inner_state(state), held), sink)
            self._end_block(state, sink)
        else:
            sink.content(held)
        return sink.pieces


class DroppedMarkersState(msgspec.Struct, omit_defaults=True):
    held: str = ""  # a possible partial marker
    inner: Any = None

    def __post_init__(self) -> None:
        require(len(self.held) <= 256, "held text within bounds")


class DroppedMarkersToolParser:
    """An inner parser fed the output without a family's outer markers (special tokens that frame the calls
    and are never text the model means, e.g. Step-3's ``<｜tool_calls_begin｜>``), wherever they appear.
    ``DROPPED_SPANS``: (open, close) pairs dropped with what is between them (Cohere's citation closer
    ``</co: 0:[1]>``); a span longer than ``MAX_SPAN`` or holding a character outside ``SPAN_CHARS`` is not
    one, and its opener stays text."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]] = DroppedMarkersState
    DROPPED: ClassVar[tuple[str, ...]]
    DROPPED_SPANS: ClassVar[tuple[tuple[str, str], ...]] = ()
    SPAN_CHARS: ClassVar[str] = ""  # the characters a span may hold between its open and close
    MAX_SPAN: ClassVar[int] = 200
    INNER: ClassVar[Any]

    def __init__(self, config: ToolParserConfig) -> None:
        self.config = config
        self.inner = self.INNER(config)
        self._spans = dict(self.DROPPED_SPANS)
        self._tags = (*self.DROPPED, *self._spans)
        self._firsts = "".join({m[0] for m in self._tags})

    def initial_state(self) -> DroppedMarkersState:
        return DroppedMarkersState(inner=self.inner.initial_state())

    def _inner_state(self, state: DroppedMarkersState) -> Any:
        if not isinstance(state.inner, self.inner.State):
            state.inner = msgspec.convert(state.inner, self.inner.State) if state.inner is not None \
                else self.inner.initial_state()
        return state.inner

    def feed(self, state: DroppedMarkersState, text: str) -> list[Piece]:
        inner = self._inner_state(state)
        if not state.held and not any(c in text for c in self._firsts):
            return self.inner.feed(inner, text) if text else []  # the per-token common case
        buf = state.held + text if state.held else text
        state.held = ""
        kept: list[str] = []
        pos = 0
        while True:
            at, tag = find_tag(buf, pos, self._tags)
            kept.append(buf[pos:at])
            if tag is None:
                state.held = buf[at:]
                break
            pos = at + len(tag)
            close = self._spans.get(tag)
            if close is not None:
                end = buf.find(close, pos, at + self.MAX_SPAN)
                stop = end if end != -1 else len(buf)
                if buf[pos:stop].strip(self.SPAN_CHARS):
                    kept.append(tag)  # it holds what a span cannot: this opener is text
                elif end != -1:
                    pos = end + len(close)
                elif len(buf) - at < self.MAX_SPAN:
                    state.held = buf[at:]  # the span may close in the next text
                    break
                else:
                    kept.append(tag)  # no close within reach: not a span
        clean = "".join(kept)
        return self.inner.feed(inner, clean) if clean else []

    def finish(self, state: DroppedMarkersState) -> list[Piece]:
        inner = self._inner_state(state)
        held, state.held = state.held, ""
        pieces: list[Piece] = self.inner.feed(inner, held) if held else []
        pieces.extend(self.inner.finish(inner))
        return pieces
