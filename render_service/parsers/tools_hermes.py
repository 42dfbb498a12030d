"""hermes: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` per call (Qwen2.5, Qwen3, Hermes).

Streaming follows vLLM's current hermes parser: content is the text before the first call; the name goes out
once it is complete; arguments stream as the model's raw text after ``"arguments":``, delimited by
string-aware brace matching, so a ``</tool_call>`` or a brace inside a string value does not end the call.
Text between and after calls is not content. See docs/tool_parsers.md for where batch differs from vLLM.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.call_object import DONE, MALFORMED, MORE, OBJ_START, CallObject, feed_call_object
from render_service.parsers.tags import find_tag, is_partial_tag
from render_service.parsers.tools_common import Count, HeldTextToolParser, PieceSink, require

START = "<tool_call>"
END = "</tool_call>"
ARG_KEYS = ("arguments", "parameters")

class HermesMode(IntEnum):
    """Where a hermes stream is: plain content, inside a <tool_call>, or just past one (in stream_state: its int)."""

    CONTENT = 0
    CALL = 1
    AFTER_CALL = 2


CONTENT, CALL, AFTER_CALL = HermesMode  # module-level names: the hot loops compare against globals


class HermesState(msgspec.Struct):
    mode: HermesMode = CONTENT
    held: str = ""
    # calls whose name went out; also the index of the call in progress
    calls: Count = 0
    # the current call's text since its start tag, kept only until its name is known so that a call that
    # turns out malformed before anything was emitted can still be returned as content
    raw: str = ""
    call: CallObject | None = None

    def __post_init__(self) -> None:
        require((self.mode == CALL) == (self.call is not None), "a call object exactly while in a call")


class HermesToolParser(HeldTextToolParser):
    name: ClassVar[str] = "hermes"
    State: ClassVar[type[msgspec.Struct]] = HermesState

    def finish(self, state: HermesState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == CONTENT:
            if state.calls == 0:
                sink.content(state.held)
        elif state.mode == CALL and state.call is not None and not state.call.name_emitted:
            self._release(state, sink, state.held)
        # A call cut off after its name keeps what was streamed: we never invent closing braces.
        state.held = ""
        state.raw = ""
        state.call = None
        state.mode = AFTER_CALL if state.calls else CONTENT
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _start_call(self, state: HermesState) -> None:
        state.mode = CALL
        state.raw = START
        state.call = CallObject()

    def _end_call(self, state: HermesState, next_mode: HermesMode) -> None:
        state.calls += 1
        state.mode = next_mode
        state.raw = ""
        state.call = None

    def _release(self, state: HermesState, sink: PieceSink, extra: str = "") -> None:
        """A call that never got a name is not a call: its text is content (if content is still open)."""
        if state.calls == 0:
            sink.content(state.raw + extra)
        state.mode = CONTENT
        state.raw = ""
        state.call = None

    def _run(self, state: HermesState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        literal_angle = False
        while pos < n:
            if state.mode == CONTENT:
                at, tag = find_tag(buf, pos, (START,))
                if state.calls == 0:
                    sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(START)
                self._start_call(state)
            elif state.mode == AFTER_CALL:
                at, tag = find_tag(buf, pos, (END, START))
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                if tag == START:
                    self._start_call(state)
                else:
                    state.mode = CONTENT
            else:
                call = cast(CallObject, state.call)  # the state's __post_init__ requires it in this mode
                end = pos + 1 if literal_angle else n
                stop, outcome = feed_call_object(
                    call, buf, pos, end, sink, state.calls, ARG_KEYS, not literal_angle
                )
                literal_angle = False
                state.raw = "" if call.name_emitted else state.raw + buf[pos:stop]
                pos = stop
                if outcome == MORE:
                    if stop < end:
                        state.held = buf[pos:]
                        return
                elif outcome in (DONE, MALFORMED):
                    # after the object (or where it broke) only a closing or next opening tag matters
                    if call.name_emitted:
                        self._end_call(state, AFTER_CALL)
                    else:
                        self._release(state, sink)
                # ANGLE: a "<" outside any string; is it a tag?
                elif buf.startswith(START, pos) and call.phase == OBJ_START:
                    # a repeated start tag (<tool_call><tool_call>) opens nothing new
                    state.raw += START
                    pos += len(START)
                elif buf.startswith(END, pos) or buf.startswith(START, pos):
                    # the call ends here, complete or not; an unnamed one is content
                    if call.name_emitted:
                        self._end_call(state, CONTENT)
                        if buf.startswith(END, pos):
                            pos += len(END)
                    else:
                        self._release(state, sink)
                elif is_partial_tag(buf[pos:], (END, START)):
                    state.held = buf[pos:]
                    return
                else:
                    literal_angle = True
