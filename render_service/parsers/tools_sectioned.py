"""Calls framed by special-token markers: section begin, (call begin, name, separator, arguments, call end)*,
section end (deepseek_v31, kimi_k2).

The name is announced at the separator (vLLM's chunking); arguments then stream as the model's raw text
through ``json_guard``, so they always end as a JSON object (``{}`` when there are none, or when what follows
the separator is not an object: that text is content). The markers end a call wherever they appear (they are
special tokens). Nothing the model wrote is dropped: text before, between and after calls is content
(whitespace right after a call or marker is layout), and a call that is not one (no separator, a name the
format cannot carry) is returned as content with its markers.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.json_guard import (
    GUARD_DONE,
    GUARD_ERROR,
    ArgsGuard,
    close_guard,
    feed_guard,
)
from render_service.parsers.json_guard import START as GUARD_START
from render_service.parsers.tags import find_tag, is_partial_tag, skip_whitespace
from render_service.parsers.tools_common import MAX_NAME_CHARS, Count, HeldTextToolParser, PieceSink, require


class SectionMode(IntEnum):
    """Where a marker-framed stream is. Travels in stream_state as its int."""

    SEC_CONTENT = 0
    SEC_SECTION = 1  # inside a section, between calls
    SEC_NAME = 2
    SEC_ARGS = 3
    SEC_AFTER_ARGS = 4  # after a call's arguments object, before its end marker
    SEC_JUNK = 5  # a call that is not one: its text up to its end marker is content
    SEC_PENDING = 6  # a call whose name its arguments decide: held (bounded) until its end marker


SEC_CONTENT, SEC_SECTION, SEC_NAME, SEC_ARGS, SEC_AFTER_ARGS, SEC_JUNK, SEC_PENDING = SectionMode
# the arguments of a call whose name they decide, held until the call ends; past this the call is content
MAX_PENDING_ARGS = 8192


class SectionedState(msgspec.Struct, omit_defaults=True):
    mode: SectionMode = SEC_CONTENT
    held: str = ""
    calls: Count = 0
    raw: str = ""  # the current call's text since its begin marker, until it is announced
    guard: ArgsGuard | None = None
    after_call: bool = False  # whitespace right after a call or marker is layout
    stray: bool = False  # inside text that is not markup (content runs to the next marker)
    pending: str = ""  # SEC_PENDING: the arguments so far

    def __post_init__(self) -> None:
        require((self.mode == SEC_ARGS) == (self.guard is not None), "a guard exactly while in arguments")
        require(len(self.raw) <= MAX_NAME_CHARS + 256, "held text within bounds")
        require(len(self.pending) <= MAX_PENDING_ARGS and (self.mode == SEC_PENDING or not self.pending),
                "pending arguments within bounds, only while pending")


class SectionedToolParser(HeldTextToolParser):
    """Base for marker-framed formats; subclasses set the markers and how the name line is read."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]] = SectionedState
    SECTION_BEGIN: ClassVar[tuple[str, ...]]
    CALL_BEGIN: ClassVar[str]
    NAME_END: ClassVar[str]
    CALL_END: ClassVar[str]
    SECTION_END: ClassVar[tuple[str, ...]]
    # a code fence closing the arguments (DeepSeek-V3 writes them in a ```json block): layout, like whitespace
    ARGS_FENCE: ClassVar[str | None] = None

    def read_name(self, text: str, index: int) -> tuple[str, str | None] | None:
        """(function name, the model's own call id or None) from the text between call begin and separator;
        None when the text names no call."""
        name = text.strip()
        if not name or any(c in name for c in "\n{}<>"):
            return None
        return name, None

    def name_from_arguments(self, text: str, arguments: str, index: int) -> tuple[str, str | None] | None:
        """A call whose name text named no call may still be named by its arguments (the family decides);
        called with the whole arguments text once the call ends. None: not a call."""
        return None

    def defers_name(self, text: str) -> bool:
        """True when ``name_from_arguments`` may name the call this name text did not."""
        return False

    def finish(self, state: SectionedState) -> list[Piece]:
        sink = PieceSink()
        mode = state.mode
        if mode == SEC_ARGS:
            # a partial marker held back is argument text after all
            guard = cast(ArgsGuard, state.guard)
            stop, emitted, status = feed_guard(guard, state.held, 0, len(state.held))
            sink.arguments(state.calls, emitted)
            self._close(state, sink)
            sink.content(state.held[stop:])
            state.calls += 1
        elif mode == SEC_NAME:
            sink.content(state.raw + state.held)
        elif mode == SEC_PENDING:
            sink.content(state.raw + state.pending + state.held)  # cut off before its arguments closed
        else:
            sink.content(state.held)
            if mode == SEC_AFTER_ARGS:
                state.calls += 1
        state.held = ""
        state.raw = ""
        state.pending = ""
        state.guard = None
        state.mode = SEC_CONTENT
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _close(self, state: SectionedState, sink: PieceSink) -> None:
        """Close the arguments (a cut or broken object is completed; what the guard dropped is content)."""
        guard = state.guard
        if guard is not None:
            closing, dropped = close_guard(guard)
            sink.arguments(state.calls, closing)
            sink.content(dropped)
        state.guard = None

    def _release(self, state: SectionedState, sink: PieceSink, text: str) -> None:
        """Not a call: its text (markers included) is content, up to its end marker."""
        sink.content(state.raw + text)
        state.raw = ""
        state.guard = None
        state.mode = SEC_JUNK

    def _end_call(self, state: SectionedState, tag: str) -> None:
        state.calls += 1
        state.mode = SEC_CONTENT if tag in self.SECTION_END else SEC_SECTION
        state.after_call = True
        state.stray = False

    def _run(self, state: SectionedState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        ends = (self.CALL_END,) + self.SECTION_END
        while pos < n:
            mode = state.mode
            if mode in (SEC_CONTENT, SEC_SECTION, SEC_AFTER_ARGS, SEC_JUNK):
                if state.after_call and not state.stray:
                    pos = skip_whitespace(buf, pos)
                    fence = self.ARGS_FENCE
                    if fence and mode == SEC_AFTER_ARGS and pos < n and buf[pos] == fence[0]:
                        if buf.startswith(fence, pos):
                            pos += len(fence)
                            continue
                        if fence.startswith(buf[pos:]):
                            state.held = buf[pos:]
                            return
                    if pos >= n:
                        return
                if mode == SEC_CONTENT:
                    tags = self.SECTION_BEGIN + (self.CALL_BEGIN,)
                elif mode == SEC_SECTION:
                    tags = (self.CALL_BEGIN,) + self.SECTION_END + self.SECTION_BEGIN + (self.CALL_END,)
                else:
                    tags = ends + (self.CALL_BEGIN,)
                at, tag = find_tag(buf, pos, tags)
                if at > pos:
                    sink.content(buf[pos:at])
                    state.stray = mode != SEC_CONTENT
                    state.after_call = False
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.stray = False
                state.after_call = True
                if tag == self.CALL_BEGIN:
                    if mode == SEC_AFTER_ARGS:
                        state.calls += 1  # the next call begins without this one's end marker
                    state.raw = tag
                    state.mode = SEC_NAME
                    state.after_call = False
                elif mode == SEC_JUNK and tag == self.CALL_END:
                    sink.content(tag)  # the end of a call that was not one: its text is content
                    state.mode = SEC_SECTION
                elif mode == SEC_AFTER_ARGS:
                    self._end_call(state, tag)
                elif tag in self.SECTION_END:
                    state.mode = SEC_CONTENT
                elif tag in self.SECTION_BEGIN:
                    state.mode = SEC_SECTION
                # a stray call end marker between calls is markup
            elif mode == SEC_NAME:
                at, tag = find_tag(buf, pos, (self.NAME_END, self.CALL_BEGIN) + ends)
                if tag is None:
                    if n - pos > MAX_NAME_CHARS:
                        self._release(state, sink, buf[pos:])  # not a name: the text is content
                        return
                    state.held = buf[pos:]
                    return
                text = buf[pos:at]
                read = self.read_name(text, state.calls) if tag == self.NAME_END else None
                if read is None and tag == self.NAME_END and self.defers_name(text):
                    state.raw += text + tag  # given back as content if the arguments name no call either
                    state.mode = SEC_PENDING
                    pos = at + len(tag)
                    continue
                if read is None:
                    self._release(state, sink, text)
                    pos = at
                    continue
                sink.name(state.calls, read[0], read[1])
                state.raw = ""
                state.guard = ArgsGuard()
                state.mode = SEC_ARGS
                pos = at + len(tag)
            elif mode == SEC_PENDING:
                at, tag = find_tag(buf, pos, ends + (self.CALL_BEGIN,))
                state.pending += buf[pos:at]
                if len(state.pending) > MAX_PENDING_ARGS:
                    text, state.pending = state.pending, ""
                    self._release(state, sink, text)
                    state.held = buf[at:] if tag is None else ""
                    if tag is None:
                        return
                    pos = at
                    continue
                if tag is None:
                    state.held = buf[at:]
                    return
                self._resolve_pending(state, sink)
                pos = at
            else:  # SEC_ARGS
                guard = cast(ArgsGuard, state.guard)  # the state's __post_init__ requires it in this mode
                if guard.phase == GUARD_START:  # what do the arguments begin with?
                    pos = skip_whitespace(buf, pos)
                    if pos >= n:
                        return
                    rest = buf[pos:pos + 64]
                    if buf[pos] != "{":
                        if is_partial_tag(rest, ends) and not any(rest.startswith(t) for t in ends):
                            state.held = buf[pos:]
                            return
                        # no arguments ({}), or not an object ({}, and the text is content)
                        self._close(state, sink)
                        state.mode = SEC_AFTER_ARGS
                        state.stray = not any(rest.startswith(t) for t in ends)
                        state.after_call = not state.stray
                        continue
                at, tag = find_tag(buf, pos, ends)
                stop, emitted, status = feed_guard(guard, buf, pos, at)
                sink.arguments(state.calls, emitted)
                if status != GUARD_DONE and status != GUARD_ERROR and tag is None:
                    state.held = buf[at:]
                    return
                self._close(state, sink)
                state.mode = SEC_AFTER_ARGS
                state.after_call = True
                state.stray = status == GUARD_ERROR
                pos = stop if status in (GUARD_DONE, GUARD_ERROR) else at

    def _resolve_pending(self, state: SectionedState, sink: PieceSink) -> None:
        """The call's end: name it from its arguments and emit it whole, or give its text back as content."""
        arguments, state.pending = state.pending, ""
        name_text = state.raw[len(self.CALL_BEGIN):len(state.raw) - len(self.NAME_END)]
        read = self.name_from_arguments(name_text, arguments, state.calls)
        if read is None:
            self._release(state, sink, arguments)
            return
        sink.name(state.calls, read[0], read[1])
        state.raw = ""
        guard = ArgsGuard()
        start = len(arguments) - len(arguments.lstrip())
        stop, emitted, status = feed_guard(guard, arguments, start, len(arguments))
        sink.arguments(state.calls, emitted)
        state.guard = guard
        self._close(state, sink)
        rest = arguments[stop:] if status in (GUARD_DONE, GUARD_ERROR) else ""
        if rest.strip():
            sink.content(rest)
        state.mode = SEC_AFTER_ARGS
        state.after_call = True
