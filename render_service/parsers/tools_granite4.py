"""granite4: Granite 4's calls, hermes markup with Granite's rules.

    text <tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call> more text <tool_call>...</tool_call>

As upstream's granite4 parser: text before, between and after calls is content (hermes drops what follows a
call), a call goes out whole once its ``</tool_call>`` arrives (name and arguments in one piece), and
``arguments`` given as a string holding a JSON object is passed through. Whitespace right after a call is
layout, not content (upstream returns it; a newline between two calls would otherwise be the reply's content).

Both invariants hold: a call is emitted only when its JSON parsed into a name and an arguments object, so its
arguments are always a JSON object; a block that is not such a call (malformed JSON, no name, arguments that
are not an object, or cut off by the end of output) comes back as content, markup included, so nothing the
model wrote is lost. The JSON is scanned as it arrives (string-aware, so ``</tool_call>`` inside a string
value does not end the call) and parsed once, at its end tag; a call's text is held until then, so in streaming
derender one call is bounded by the ``stream_state`` cap (64 KiB), like a typed qwen3_coder value.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any, ClassVar

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.json_scan import JsonScan, dumps, scan_json_value
from render_service.parsers.tags import find_tag, is_partial_tag, skip_whitespace
from render_service.parsers.tools_common import MAX_NAME_CHARS, Count, HeldTextToolParser, PieceSink, require

START = "<tool_call>"
END = "</tool_call>"


class Granite4Mode(IntEnum):
    """Where a granite4 stream is. Travels in stream_state as its int."""

    CONTENT = 0
    CALL = 1  # inside <tool_call>, reading the JSON object
    CLOSE = 2  # after the object, waiting for </tool_call>


CONTENT, CALL, CLOSE = Granite4Mode


class Granite4State(msgspec.Struct):
    mode: Granite4Mode = CONTENT
    held: str = ""
    calls: Count = 0
    after_call: bool = False  # whitespace right after a call is layout
    parts: list[str] = []  # the current block's text since <tool_call>
    scan: JsonScan = msgspec.field(default_factory=JsonScan)

    def __post_init__(self) -> None:
        require(self.mode != CONTENT or not self.parts, "no held call text outside a call")


def _call_from(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON object) from a call's JSON text, or None when it is not a call."""
    try:
        obj: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            return None
        return (name, args.strip()) if isinstance(decoded, dict) else None
    return (name, dumps(args)) if isinstance(args, dict) else None


class Granite4ToolParser(HeldTextToolParser):
    name: ClassVar[str] = "granite4"
    State: ClassVar[type[msgspec.Struct]] = Granite4State

    def finish(self, state: Granite4State) -> list[Piece]:
        sink = PieceSink()
        if state.mode == CONTENT:
            sink.content(state.held)
        else:  # a call cut off before its end tag is not a call: its text is content
            sink.content(START + "".join(state.parts) + state.held)
        state.held = ""
        state.parts = []
        state.mode = CONTENT
        return sink.pieces

    def _not_a_call(self, state: Granite4State, sink: PieceSink, extra: str) -> None:
        sink.content(START + "".join(state.parts) + extra)
        state.parts = []
        state.mode = CONTENT

    def _run(self, state: Granite4State, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            if state.mode == CONTENT:
                if state.after_call:
                    pos = skip_whitespace(buf, pos)
                    if pos >= n:
                        return
                    state.after_call = False
                at, tag = find_tag(buf, pos, (START,))
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(START)
                state.mode = CALL
                state.parts = []
                state.scan = JsonScan()
            elif state.mode == CALL:
                if not state.scan.started:
                    start = skip_whitespace(buf, pos)
                    state.parts.append(buf[pos:start])
                    pos = start
                    if pos >= n:
                        return
                    if buf[pos] != "{":
                        self._not_a_call(state, sink, "")
                        continue
                stop = scan_json_value(state.scan, buf, pos, n, True)
                state.parts.append(buf[pos:stop])
                if state.scan.done:
                    state.mode = CLOSE
                elif stop < n:  # a "<" outside any string: the end tag of a malformed call?
                    if buf.startswith(END, stop) or buf.startswith(START, stop):
                        self._not_a_call(state, sink, "")
                    elif is_partial_tag(buf[stop:stop + len(END)], (END, START)):
                        state.held = buf[stop:]
                        return
                    else:
                        state.parts.append("<")
                        stop += 1
                pos = stop
            else:  # CLOSE
                start = skip_whitespace(buf, pos)
                gap = buf[pos:start]
                pos = start
                if pos >= n:
                    state.parts.append(gap)
                    return
                if buf.startswith(END, pos):
                    text = "".join(state.parts)
                    call = _call_from(text)
                    if call is None:
                        self._not_a_call(state, sink, gap + END)
                    else:
                        sink.name(state.calls, call[0])
                        sink.arguments(state.calls, call[1])
                        state.calls += 1
                        state.parts = []
                        state.mode = CONTENT
                        state.after_call = True
                    pos += len(END)
                elif is_partial_tag(buf[pos:pos + len(END)], (END,)):
                    state.parts.append(gap)
                    state.held = buf[pos:]
                    return
                else:  # something other than the end tag after the object: not a call
                    self._not_a_call(state, sink, gap)
