"""mistral: ``[TOOL_CALLS]`` followed by either a JSON array of calls (tokenizers before v11)
``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` or, from v11, one ``name{arguments}`` per marker
``[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{...}`` (v13 writes ``[TOOL_CALLS]f[ARGS]{...}``; both are accepted).

Content is the text before the first marker; arguments stream as the model's raw JSON text, their end found
by string-aware brace matching. Text after the calls is dropped.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import ClassVar, cast

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.call_object import DONE, MORE, CallObject, feed_call_object
from render_service.parsers.json_scan import JsonScan, scan_json_value
from render_service.parsers.tags import find_tag, skip_whitespace
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


class MistralState(msgspec.Struct):
    mode: MistralMode = CONTENT
    held: str = ""
    calls: Count = 0
    # text since the marker until the first call's name is known
    raw: str = ""
    call: CallObject | None = None
    scan: JsonScan | None = None

    def __post_init__(self) -> None:
        require((self.mode == OBJECT) == (self.call is not None), "a call object exactly while in one")
        require((self.mode == V11_ARGS) == (self.scan is not None), "a scan exactly while in arguments")


class MistralToolParser(HeldTextToolParser):
    name: ClassVar[str] = "mistral"
    State: ClassVar[type[msgspec.Struct]] = MistralState
    # Mistral chat templates require 9-alphanumeric call ids (pipeline.tool_call_id)
    call_id_style: ClassVar[str] = "mistral"

    def finish(self, state: MistralState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == CONTENT:
            if state.calls == 0:
                sink.content(state.held)
        elif state.mode in (AFTER_MARKER, ARRAY_ITEM, V11_NAME) or (
            state.mode == OBJECT and not cast(CallObject, state.call).name_emitted
        ):
            self._release(state, sink, state.held)
        state.held = ""
        state.raw = ""
        state.call = None
        state.scan = None
        state.mode = CONTENT
        return sink.pieces

    def _release(self, state: MistralState, sink: PieceSink, extra: str = "") -> None:
        if state.calls == 0:
            sink.content(state.raw + extra)
        state.raw = ""
        state.call = None
        state.mode = CONTENT

    def _end_call(self, state: MistralState, next_mode: MistralMode) -> None:
        state.calls += 1
        state.raw = ""
        state.call = None
        state.scan = None
        state.mode = next_mode

    def _run(self, state: MistralState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == CONTENT:
                at, tag = find_tag(buf, pos, (TOOL_CALLS,))
                if state.calls == 0:
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
                if not state.calls:
                    state.raw += buf[start:pos]
                if pos >= n:
                    return
                if buf[pos] == "{":
                    state.call = CallObject()
                    state.mode = OBJECT
                elif state.calls:
                    state.mode = CONTENT  # end of the array (or junk): nothing more to parse here
                else:
                    self._release(state, sink)
            elif mode == OBJECT:
                call = cast(CallObject, state.call)  # the state's __post_init__ requires it in this mode
                stop, outcome = feed_call_object(call, buf, pos, n, sink, state.calls, ARG_KEYS, False)
                state.raw = "" if call.name_emitted else state.raw + buf[pos:stop]
                pos = stop
                if outcome == MORE:
                    if stop < n:
                        state.held = buf[pos:]
                        return
                elif call.name_emitted:
                    self._end_call(state, ARRAY_SEP if outcome == DONE else CONTENT)
                else:
                    self._release(state, sink)
            elif mode == ARRAY_SEP:
                pos = skip_whitespace(buf, pos)
                if pos >= n:
                    return
                if buf[pos] == ",":
                    pos += 1
                    state.mode = ARRAY_ITEM
                else:
                    state.mode = CONTENT  # "]" or anything else ends the array
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
                pos = at + (len(ARGS) if at == bracket else 0)
                state.raw = ""
                state.scan = JsonScan()
                state.mode = V11_ARGS
                sink.name(state.calls, name)
            else:  # V11_ARGS
                scan = cast(JsonScan, state.scan)  # the state's __post_init__ requires it in this mode
                if not scan.started:
                    pos = skip_whitespace(buf, pos)
                    if pos >= n:
                        return
                stop = scan_json_value(scan, buf, pos, n, False)
                sink.arguments(state.calls, buf[pos:stop])
                pos = stop
                if scan.done:
                    self._end_call(state, CONTENT)
