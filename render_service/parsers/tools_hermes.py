"""hermes: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` per call (Qwen2.5, Qwen3, Hermes).

Streaming follows vLLM's current hermes parser where it can: the name goes out once complete (and once the
arguments are known to be an object), arguments stream as the model's raw text after ``"arguments":``,
delimited by string-aware brace matching, so a ``</tool_call>`` or a brace inside a string value does not end
the call. Unlike vLLM, the arguments are guarded (``json_guard``: always a JSON object at the end) and nothing
the model wrote is dropped: text before, between and after calls is content (whitespace right after a call is
layout), a block that is not a call is content, text inside a call after its object is content. See
docs/tool_parsers.md.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece, TextPiece
from render_service.parsers.call_object import (
    DONE,
    MALFORMED,
    MAX_UNANNOUNCED,
    MORE,
    OBJ_START,
    CallObject,
    feed_call_object,
    finish_call_object,
)
from render_service.parsers.tags import find_tag, is_partial_tag, skip_layout, skip_whitespace
from render_service.parsers.tools_common import Count, HeldTextToolParser, PieceSink, require

START = "<tool_call>"
END = "</tool_call>"
ARG_KEYS = ("arguments", "parameters")


class HermesMode(IntEnum):
    """Where a hermes stream is: plain content, inside a <tool_call>, or inside one past its object (in
    stream_state: its int)."""

    CONTENT = 0
    CALL = 1
    AFTER_CALL = 2


CONTENT, CALL, AFTER_CALL = HermesMode  # module-level names: the hot loops compare against globals


class HermesState(msgspec.Struct, omit_defaults=True):
    mode: HermesMode = CONTENT
    held: str = ""
    # calls announced so far; also the index of the call in progress
    calls: Count = 0
    # the current call's text since its start tag, kept only until the call is announced so that a block
    # that turns out not to be a call can still be returned as content
    raw: str = ""
    call: CallObject | None = None
    after_call: bool = False  # whitespace right after a call is layout
    stray: bool = False  # inside text that follows a call's object within its tags (content up to the tag)

    def __post_init__(self) -> None:
        require((self.mode == CALL) == (self.call is not None), "a call object exactly while in a call")
        require(len(self.raw) <= MAX_UNANNOUNCED + 4096, "unannounced call text within bounds")


class HermesToolParser(HeldTextToolParser):
    name: ClassVar[str] = "hermes"
    State: ClassVar[type[msgspec.Struct]] = HermesState
    # the tags around each call's JSON object: a family of this shape is a subclass naming its own
    START: ClassVar[str] = START
    END: ClassVar[str] = END
    LAYOUT_AFTER_CALL: ClassVar[bool] = True  # whitespace right after a call's end tag is layout, not content

    def finish(self, state: HermesState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == CALL:
            call = cast(CallObject, state.call)
            if finish_call_object(call, sink, state.calls):
                state.calls += 1
                sink.content(state.held)
            else:
                sink.content(state.raw + state.held)
        else:
            sink.content(state.held)
        state.held = ""
        state.raw = ""
        state.call = None
        state.mode = CONTENT
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _start_call(self, state: HermesState) -> None:
        state.mode = CALL
        state.raw = self.START
        state.call = CallObject()

    def _end_call(self, state: HermesState) -> None:
        state.calls += 1
        state.mode = AFTER_CALL
        state.stray = False
        state.raw = ""
        state.call = None

    def _release(self, state: HermesState, sink: PieceSink) -> None:
        """A block that is not a call: its text is content, and scanning goes on from here."""
        sink.content(state.raw)
        state.mode = CONTENT
        state.raw = ""
        state.call = None

    def _run(self, state: HermesState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        literal_angle = False
        while pos < n:
            mode = state.mode
            if mode == CONTENT:
                if state.after_call:
                    pos = skip_layout(state, buf, pos)
                    if pos >= n:
                        return
                at, tag = find_tag(buf, pos, (self.START,))
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(self.START)
                self._start_call(state)
            elif mode == AFTER_CALL:
                if not state.stray:
                    pos = skip_whitespace(buf, pos)
                    if pos >= n:
                        return
                at, tag = find_tag(buf, pos, (self.END, self.START))
                if at > pos:
                    sink.content(buf[pos:at])  # the model's text after the object, inside the call's tags
                    state.stray = True
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.stray = False
                if tag == self.START:
                    self._start_call(state)
                else:
                    state.mode = CONTENT
                    state.after_call = self.LAYOUT_AFTER_CALL
            else:
                call = cast(CallObject, state.call)  # the state's __post_init__ requires it in this mode
                end = pos + 1 if literal_angle else n
                stop, outcome = feed_call_object(
                    call, buf, pos, end, sink, state.calls, ARG_KEYS, not literal_angle
                )
                literal_angle = False
                state.raw = "" if call.name_emitted else state.raw + buf[pos:stop]
                pos = stop
                if not call.name_emitted and len(state.raw) > MAX_UNANNOUNCED:
                    self._release(state, sink)  # too long to still be a call's envelope
                elif outcome == MORE:
                    if stop < end:
                        state.held = buf[pos:]
                        return
                elif outcome in (DONE, MALFORMED):
                    if finish_call_object(call, sink, state.calls):  # completes a call that broke off
                        self._end_call(state)
                    else:
                        self._release(state, sink)
                # ANGLE: a "<" outside any string; is it a tag?
                elif buf.startswith(self.START, pos) and call.phase == OBJ_START:
                    # a repeated start tag (<tool_call><tool_call>) opens nothing new
                    state.raw += self.START
                    pos += len(self.START)
                elif buf.startswith(self.END, pos) or buf.startswith(self.START, pos):
                    # the call ends here, complete or not
                    if finish_call_object(call, sink, state.calls):
                        self._end_call(state)
                    else:
                        self._release(state, sink)
                elif is_partial_tag(buf[pos:], (self.END, self.START)):
                    state.held = buf[pos:]
                    return
                else:
                    literal_angle = True


class Qwen3JsonToolParser(HermesToolParser):
    """qwen3_json: vLLM's name for Hermes' format on Qwen3 models (the same class upstream)."""

    name: ClassVar[str] = "qwen3_json"


class LongcatToolParser(HermesToolParser):
    """longcat (LongCat-Flash): Hermes' JSON calls inside ``<longcat_tool_call>`` tags (upstream subclasses
    Hermes' parser with these tags)."""

    name: ClassVar[str] = "longcat"
    START: ClassVar[str] = "<longcat_tool_call>"
    END: ClassVar[str] = "</longcat_tool_call>"


class Ernie45ToolParser(HermesToolParser):
    """ernie45 (ERNIE-4.5 thinking): ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Hermes' shape."""

    name: ClassVar[str] = "ernie45"


class RippleState(HermesState):
    newline_held: bool = False  # content's last newline, which is the next call marker's if a call follows


class RippleToolParser(HermesToolParser):
    """ripple (Ricursive Ripple): Hermes' ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``, the
    markers spelled in plain text (upstream's engine reads the same JSON and tags). The template writes
    ``\\n<tool_call>``: the newline before a call is the marker's, so content's last newline waits for what
    follows and is dropped when a call does; text after ``</tool_call>``, newline included, is content."""

    name: ClassVar[str] = "ripple"
    State: ClassVar[type[msgspec.Struct]] = RippleState
    LAYOUT_AFTER_CALL: ClassVar[bool] = False  # the end marker owns no newline after it (upstream's terminal)

    def feed(self, state: RippleState, text: str) -> list[Piece]:
        pieces = super().feed(state, text)
        return pieces if not pieces and not state.newline_held else self._frame(state, pieces)

    def finish(self, state: HermesState) -> list[Piece]:
        state = cast(RippleState, state)
        out = self._frame(state, super().finish(state))
        if state.newline_held:
            state.newline_held = False
            out.append(TextPiece("content", "\n"))
        return out

    @staticmethod
    def _frame(state: RippleState, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, TextPiece):
                text = "\n" + p.text if state.newline_held else p.text
                state.newline_held = text.endswith("\n")
                text = text[:-1] if state.newline_held else text
                if text:
                    out.append(TextPiece("content", text))
                continue
            if state.newline_held and p.name is None:  # not a call's start: the newline was the model's
                out.append(TextPiece("content", "\n"))
            state.newline_held = False
            out.append(p)
        return out
