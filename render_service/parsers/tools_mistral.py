"""mistral: ``[TOOL_CALLS]`` followed by either a JSON array of calls (tokenizers before v11)
``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` or, from v11, one ``name{arguments}`` per marker
``[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{...}`` (v13 writes ``[TOOL_CALLS]f[ARGS]{...}``; both are accepted).

Content is the text before, between and after the calls (whitespace right after a call is layout); arguments
stream as the model's raw JSON text, their end found by string-aware brace matching and guarded
(``json_guard``) so they always end as a JSON object. A v11 name is announced once its arguments begin with
``{``; a marker followed by anything else is content.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.call_object import (
    DONE,
    MAX_UNANNOUNCED,
    MORE,
    CallObject,
    feed_call_object,
    finish_call_object,
)
from render_service.parsers.json_guard import GUARD_DONE, GUARD_ERROR, ArgsGuard, close_guard, feed_guard
from render_service.parsers.tags import find_tag, skip_layout, skip_whitespace
from render_service.parsers.tools_common import (
    MAX_NAME_CHARS,
    Count,
    HeldTextToolParser,
    PieceSink,
    require,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARG_KEYS = ("arguments", "parameters")

class MistralMode(IntEnum):
    """Where a mistral stream is (pre-v11 JSON array, or v11 name/args). Travels in stream_state as its int."""

    CONTENT = 0
    AFTER_MARKER = 1
    ARRAY_ITEM = 2
    OBJECT = 3
    ARRAY_SEP = 4
    V11_NAME = 5
    V11_ARGS = 6


(
    CONTENT, AFTER_MARKER, ARRAY_ITEM, OBJECT, ARRAY_SEP, V11_NAME, V11_ARGS
) = MistralMode  # module-level names: the hot loops compare against globals

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralState(msgspec.Struct, omit_defaults=True):
    mode: MistralMode = CONTENT
    held: str = ""
    calls: Count = 0
    # text since the marker until the call is announced
    raw: str = ""
    call: CallObject | None = None
    guard: ArgsGuard | None = None  # a v11 call's arguments
    name: str = ""  # a v11 name read but not announced yet (its arguments have not begun)
    after_call: bool = False  # whitespace right after a call is layout

    def __post_init__(self) -> None:
        require((self.mode == OBJECT) == (self.call is not None), "a call object exactly while in one")
        require((self.mode == V11_ARGS) == (self.guard is not None), "a guard exactly while in arguments")
        require(len(self.raw) <= MAX_UNANNOUNCED + 4096 and len(self.name) <= MAX_NAME_CHARS, "held text bounded")


class MistralToolParser(HeldTextToolParser):
    name: ClassVar[str] = "mistral"
    State: ClassVar[type[msgspec.Struct]] = MistralState
    # Mistral chat templates require 9-alphanumeric call ids (pipeline.tool_call_id)
    call_id_style: ClassVar[str] = "mistral"

    def finish(self, state: MistralState) -> list[Piece]:
        sink = PieceSink()
        mode = state.mode
        if mode == OBJECT and finish_call_object(cast(CallObject, state.call), sink, state.calls):
            state.calls += 1
            sink.content(state.held)
        elif mode == V11_ARGS and not state.name:
            self._close_v11(state, sink)
            sink.content(state.held)
        elif mode in (CONTENT, ARRAY_SEP):
            sink.content(state.held)
        else:
            sink.content(state.raw + state.held)
        state.held = ""
        state.raw = ""
        state.name = ""
        state.call = None
        state.guard = None
        state.mode = CONTENT
        return sink.pieces

    def _release(self, state: MistralState, sink: PieceSink) -> None:
        """Not a call after all: the text since the marker is content, and scanning goes on from here."""
        sink.content(state.raw)
        state.raw = ""
        state.name = ""
        state.call = None
        state.guard = None
        state.mode = CONTENT

    def _end_call(self, state: MistralState, next_mode: MistralMode) -> None:
        state.calls += 1
        state.raw = ""
        state.call = None
        state.guard = None
        state.mode = next_mode
        state.after_call = next_mode == CONTENT

    def _close_v11(self, state: MistralState, sink: PieceSink) -> None:
        closing, dropped = close_guard(cast(ArgsGuard, state.guard))
        sink.arguments(state.calls, closing)
        sink.content(dropped)
        self._end_call(state, CONTENT)

    def _run(self, state: MistralState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == CONTENT:
                if state.after_call:
                    pos = skip_layout(state, buf, pos)
                    if pos >= n:
                        return
                at, tag = find_tag(buf, pos, (TOOL_CALLS,))
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(TOOL_CALLS)
                state.raw = TOOL_CALLS
                state.mode = AFTER_MARKER
            elif mode == AFTER_MARKER:
                start = pos
                pos = skip_whitespace(buf, pos)
                state.raw += buf[start:pos]
                if pos >= n:
                    return
                if buf[pos] == "[" and n - pos < len(ARGS) and ARGS.startswith(buf[pos:]):
                    state.held = buf[pos:]  # "[" may open the array or "[ARGS]": wait for more
                    return
                if buf[pos] == "[" and not buf.startswith(ARGS, pos):
                    state.raw += "["
                    pos += 1
                    state.mode = ARRAY_ITEM
                else:
                    state.mode = V11_NAME
            elif mode == ARRAY_ITEM:
                start = pos
                pos = skip_whitespace(buf, pos)
                state.raw += buf[start:pos]
                if pos >= n:
                    return
                if buf[pos] == "{":
                    state.call = CallObject()
                    state.mode = OBJECT
                elif state.calls and buf[pos] == "]":
                    pos += 1  # a trailing comma, then the array's end
                    self._end_array(state)
                else:
                    self._release(state, sink)
            elif mode == OBJECT:
                call = cast(CallObject, state.call)  # the state's __post_init__ requires it in this mode
                stop, outcome = feed_call_object(call, buf, pos, n, sink, state.calls, ARG_KEYS, False)
                state.raw = "" if call.name_emitted else state.raw + buf[pos:stop]
                pos = stop
                if not call.name_emitted and len(state.raw) > MAX_UNANNOUNCED:
                    self._release(state, sink)
                elif outcome == MORE:
                    if stop < n:
                        state.held = buf[pos:]
                        return
                elif finish_call_object(call, sink, state.calls):  # completes a call that broke off
                    self._end_call(state, ARRAY_SEP if outcome == DONE else CONTENT)
                    state.after_call = False  # what broke the call off is the model's text
                else:
                    self._release(state, sink)
            elif mode == ARRAY_SEP:
                pos = skip_whitespace(buf, pos)
                if pos >= n:
                    return
                if buf[pos] == ",":
                    pos += 1
                    state.mode = ARRAY_ITEM
                elif buf[pos] == "]":
                    pos += 1
                    self._end_array(state)
                else:
                    state.mode = CONTENT  # anything else ends the array: it is the model's text
            elif mode == V11_NAME:
                brace = buf.find("{", pos, pos + MAX_NAME_CHARS + 1)
                bracket = buf.find("[", pos, pos + MAX_NAME_CHARS + 1)
                ends = [i for i in (brace, bracket) if i != -1]
                if not ends:
                    partial = buf[pos:].strip()
                    if n - pos > MAX_NAME_CHARS or (partial and not _NAME.fullmatch(partial)):
                        self._release(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                at = min(ends)
                if at == bracket and not buf.startswith(ARGS, at):
                    if ARGS.startswith(buf[at:]):
                        state.held = buf[pos:]
                        return
                    self._release(state, sink)
                    continue
                name = buf[pos:at].strip()
                if not _NAME.fullmatch(name):
                    self._release(state, sink)
                    continue
                end = at + (len(ARGS) if at == bracket else 0)
                state.raw += buf[pos:end]
                pos = end
                state.name = name
                state.guard = ArgsGuard()
                state.mode = V11_ARGS
            else:  # V11_ARGS
                guard = cast(ArgsGuard, state.guard)  # the state's __post_init__ requires it in this mode
                if state.name:
                    # announced once the arguments are known to be an object
                    start = pos
                    pos = skip_whitespace(buf, pos)
                    state.raw += buf[start:pos]
                    if pos >= n:
                        return
                    if buf[pos] != "{":
                        self._release(state, sink)
                        continue
                    sink.name(state.calls, state.name)
                    state.name = ""
                    state.raw = ""
                stop, emitted, status = feed_guard(guard, buf, pos, n)
                sink.arguments(state.calls, emitted)
                pos = stop
                if status == GUARD_DONE:
                    self._end_call(state, CONTENT)
                elif status == GUARD_ERROR:
                    self._close_v11(state, sink)
                    state.after_call = False  # the rest is the model's text

    def _end_array(self, state: MistralState) -> None:
        state.raw = ""
        state.mode = CONTENT
        state.after_call = True
