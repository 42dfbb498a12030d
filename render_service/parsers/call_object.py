"""A tool call written as a JSON object, ``{"name": "f", "arguments": {...}}`` (hermes, llama3_json, mistral
pre-v11), read incrementally: the name is held until complete, the arguments stream as the model's raw text.
"""

from __future__ import annotations

import re
from enum import IntEnum

import msgspec

from render_service.parsers.json_scan import JsonScan, decode_json_string_body, json_string_safe_end, scan_json_value
from render_service.parsers.tools_common import MAX_NAME_CHARS, WHITESPACE, PieceSink


class CallPhase(IntEnum):
    """Progress through one JSON call object. Travels in stream_state as its int."""

    OBJ_START = 0
    KEY_OR_END = 1
    KEY = 2
    COLON = 3
    VALUE_START = 4
    NAME = 5
    ARGS = 6
    ARGS_STR_PEEK = 7
    ARGS_STR_DECODE = 8
    SKIP = 9


(
    OBJ_START, KEY_OR_END, KEY, COLON, VALUE_START, NAME, ARGS, ARGS_STR_PEEK, ARGS_STR_DECODE, SKIP
) = CallPhase  # module-level names: the hot loops compare against globals

# feed_call_object outcomes
class CallOutcome(IntEnum):
    """What feed_call_object reports (never serialized). Travels in stream_state as its int."""

    MORE = 0
    DONE = 1
    MALFORMED = 2
    ANGLE = 3


MORE, DONE, MALFORMED, ANGLE = CallOutcome  # module-level names: the hot loops compare against globals

MAX_KEY_CHARS = 64
_UNESCAPED_QUOTE = re.compile(r'["\\]')


class CallObject(msgspec.Struct):
    """Progress through one call object. The arguments value is streamed as the model's raw text; only the
    name (and arguments that arrive before the name, which is rare) is held."""

    phase: CallPhase = OBJ_START
    value_key: str = ""
    name_emitted: bool = False
    args_started: bool = False
    pending_args: str = ""
    str_hold: str = ""
    scan: JsonScan = msgspec.field(default_factory=JsonScan)


def _read_string(buf: str, pos: int, end: int) -> int:
    """Index of the closing quote of a JSON string body starting at pos (escapes honoured), or -1."""
    i = pos
    while True:
        m = _UNESCAPED_QUOTE.search(buf, i, end)
        if m is None:
            return -1
        i = m.start()
        if buf[i] == '"':
            return i
        i += 2
        if i > end:
            return -1


def _emit_args(obj: CallObject, sink: PieceSink, index: int, text: str) -> None:
    if not text:
        return
    obj.args_started = True
    if obj.name_emitted:
        sink.arguments(index, text)
    else:
        obj.pending_args += text


def feed_call_object(
    obj: CallObject,
    buf: str,
    pos: int,
    end: int,
    sink: PieceSink,
    index: int,
    arg_keys: tuple[str, ...],
    stop_at_angle: bool,
) -> tuple[int, int]:
    """Advance the call object over buf[pos:end]. Returns (position reached, outcome).

    MORE: everything up to ``end`` consumed except a short suffix the caller must hold back and feed again
    (returned position < end only when a key or name string is unfinished: those are re-read whole).
    DONE: the object closed just before the returned position. MALFORMED: the text at the returned position
    cannot continue a call object. ANGLE: a ``<`` outside any string at the returned position (the caller
    decides whether it starts a tag; if not, it feeds that one character again with stop_at_angle False).
    """
    i = pos
    while i < end:
        phase = obj.phase
        if phase in (OBJ_START, KEY_OR_END, COLON, VALUE_START):
            while i < end and (buf[i] in WHITESPACE or (phase == KEY_OR_END and buf[i] == ",")):
                i += 1
            if i >= end:
                return end, MORE
            c = buf[i]
            if c == "<" and stop_at_angle:
                return i, ANGLE
            if phase == OBJ_START:
                if c != "{":
                    return i, MALFORMED
                obj.phase = KEY_OR_END
                i += 1
            elif phase == KEY_OR_END:
                if c == "}":
                    if obj.name_emitted and not obj.args_started:
                        _emit_args(obj, sink, index, "{}")
                    return i + 1, DONE
                if c != '"':
                    return i, MALFORMED
                obj.phase = KEY
                i += 1
            elif phase == COLON:
                if c != ":":
                    return i, MALFORMED
                obj.phase = VALUE_START
                i += 1
            else:
                key = obj.value_key
                if key == "name":
                    if c != '"' or obj.name_emitted:
                        return i, MALFORMED
                    obj.phase = NAME
                    i += 1
                elif key in arg_keys and not obj.args_started:
                    obj.scan = JsonScan()
                    if c == '"':
                        obj.phase = ARGS_STR_PEEK
                        i += 1
                    else:
                        obj.phase = ARGS
                else:
                    obj.scan = JsonScan()
                    obj.phase = SKIP
        elif phase == KEY or phase == NAME:
            q = _read_string(buf, i, end)
            if q == -1:
                # an unfinished key or name is re-read whole next time (both are short)
                if end - i > (MAX_KEY_CHARS if phase == KEY else MAX_NAME_CHARS):
                    return i, MALFORMED
                return i, MORE
            raw = buf[i:q]
            i = q + 1
            if phase == KEY:
                obj.value_key = raw if len(raw) <= MAX_KEY_CHARS else ""
                obj.phase = COLON
            else:
                try:
                    name = decode_json_string_body(raw)
                except ValueError:
                    return q, MALFORMED
                if not name or len(name) > MAX_NAME_CHARS:
                    return q, MALFORMED
                obj.name_emitted = True
                sink.name(index, name)
                if obj.pending_args:
                    sink.arguments(index, obj.pending_args)
                    obj.pending_args = ""
                obj.phase = KEY_OR_END
        elif phase == ARGS or phase == SKIP:
            stop = scan_json_value(obj.scan, buf, i, end, stop_at_angle)
            if phase == ARGS:
                _emit_args(obj, sink, index, buf[i:stop])
            i = stop
            if obj.scan.done:
                obj.phase = KEY_OR_END
            elif i < end:
                return i, ANGLE
        elif phase == ARGS_STR_PEEK:
            if buf[i] in "{[":
                obj.phase = ARGS_STR_DECODE
            else:
                # a plain string stays what it is: its raw JSON text, quotes included
                _emit_args(obj, sink, index, '"')
                obj.scan = JsonScan(started=True, in_string=True)
                obj.phase = ARGS
        else:  # ARGS_STR_DECODE: arguments serialised as a string holding JSON are decoded once
            held = obj.str_hold
            text = held + buf[i:end]
            q = _read_string(text, 0, len(text))
            if q == -1:
                safe = json_string_safe_end(text)
                body, obj.str_hold = text[:safe], text[safe:]
                i = end
            else:
                body, obj.str_hold = text[:q], ""
                i = i + (q - len(held)) + 1
                obj.phase = KEY_OR_END
            try:
                _emit_args(obj, sink, index, decode_json_string_body(body))
            except ValueError:
                return i, MALFORMED
    return end, MORE
