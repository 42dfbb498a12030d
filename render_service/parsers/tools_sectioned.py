"""Calls framed by special-token markers: section begin, (call begin, name, separator, arguments, call end)*,
section end (deepseek_v31, kimi_k2). Arguments are the model's raw text between separator and call end.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.tags import find_tag
from render_service.parsers.tools_common import MAX_NAME_CHARS, Count, HeldTextToolParser, PieceSink


class SectionMode(IntEnum):
    """Where a marker-framed stream is. Travels in stream_state as its int."""

    SEC_CONTENT = 0
    SEC_SECTION = 1
    SEC_NAME = 2
    SEC_ARGS = 3


SEC_CONTENT, SEC_SECTION, SEC_NAME, SEC_ARGS = SectionMode  # module-level names: the hot loops compare against globals


class SectionedState(msgspec.Struct):
    mode: SectionMode = SEC_CONTENT
    held: str = ""
    calls: Count = 0
    args_started: bool = False


class SectionedToolParser(HeldTextToolParser):
    """Base for marker-framed formats; subclasses set the markers and how the name line is read."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]] = SectionedState
    SECTION_BEGIN: ClassVar[tuple[str, ...]]
    CALL_BEGIN: ClassVar[str]
    NAME_END: ClassVar[str]
    CALL_END: ClassVar[str]
    SECTION_END: ClassVar[tuple[str, ...]]
    # strip whitespace around the arguments (kimi does, deepseek keeps the raw text)
    TRIM_ARGUMENTS: ClassVar[bool] = False

    def read_name(self, text: str) -> tuple[str, str | None]:
        """(function name, the model's own call id or None) from the text between call begin and separator."""
        return text.strip(), None

    def finish(self, state: SectionedState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == SEC_CONTENT and state.calls == 0:
            sink.content(state.held)
        # a call cut off inside its name or arguments stays as streamed; nothing is invented
        state.held = ""
        state.mode = SEC_CONTENT
        return sink.pieces

    def _end_call(self, state: SectionedState, sink: PieceSink, next_mode: SectionMode) -> None:
        if not state.args_started:
            sink.arguments(state.calls, "{}")
        state.calls += 1
        state.mode = next_mode

    def _run(self, state: SectionedState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == SEC_CONTENT:
                at, tag = find_tag(buf, pos, self.SECTION_BEGIN + (self.CALL_BEGIN,))
                if state.calls == 0:
                    sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.mode = SEC_NAME if tag == self.CALL_BEGIN else SEC_SECTION
            elif mode == SEC_SECTION:
                at, tag = find_tag(buf, pos, (self.CALL_BEGIN,) + self.SECTION_END + self.SECTION_BEGIN)
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                if tag == self.CALL_BEGIN:
                    state.mode = SEC_NAME
                elif tag in self.SECTION_END:
                    state.mode = SEC_CONTENT
            elif mode == SEC_NAME:
                at, tag = find_tag(buf, pos, (self.NAME_END, self.CALL_END) + self.SECTION_END)
                if tag is None:
                    if n - pos > MAX_NAME_CHARS:
                        state.mode = SEC_SECTION  # not a name: skip this call
                        pos = n
                        continue
                    state.held = buf[pos:]
                    return
                name, call_id = self.read_name(buf[pos:at])
                pos = at + len(tag)
                if tag != self.NAME_END or not name:
                    state.mode = SEC_SECTION if tag == self.CALL_END else SEC_CONTENT
                    continue
                sink.name(state.calls, name, call_id)
                state.args_started = False
                state.mode = SEC_ARGS
            else:  # SEC_ARGS
                at, tag = find_tag(buf, pos, (self.CALL_END,) + self.SECTION_END)
                chunk = buf[pos:at]
                if self.TRIM_ARGUMENTS:
                    if not state.args_started:
                        chunk = chunk.lstrip()
                    kept = chunk.rstrip()
                    # trailing whitespace is dropped at the end tag, held back before it
                    held_from = at if tag is not None else at - (len(chunk) - len(kept))
                else:
                    kept, held_from = chunk, at
                if kept:
                    state.args_started = True
                    sink.arguments(state.calls, kept)
                if tag is None:
                    state.held = buf[held_from:]
                    return
                pos = at + len(tag)
                self._end_call(state, sink, SEC_SECTION if tag == self.CALL_END else SEC_CONTENT)
