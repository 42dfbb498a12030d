"""A tool call written as a JSON object, ``{"name": "f", "arguments": {...}}`` (hermes, llama3_json, mistral
pre-v11), read incrementally.

The name is announced as soon as it is complete (vLLM's chunking), or, for a family whose calls are bare
objects in the text (``CallKeys.announce_at_args``: Llama), once the arguments key follows it too: an object
with a ``"name"`` and no arguments (``{"name": "John", "age": 30}``) is the model's text, not a call. The
arguments then stream as the model's raw text through ``json_guard``, which keeps them valid JSON; a string
holding the object (``"arguments": "{\\"a\\": 1}"``) is decoded once and guarded the same way. Arguments
that are not an object (a list, a number, a plain string) cannot be a call's arguments: the call gets ``{}``
and their text goes to content. Other members of the envelope (``"id": ...``) are the model's text too: content.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import cast

import msgspec

from render_service.parsers.json_guard import (
    GUARD_DONE,
    GUARD_ERROR,
    GUARD_MORE,
    ArgsGuard,
    GuardStatus,
    close_guard,
    feed_guard,
)
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
    ARGS_STR_REST = 10  # the rest of an arguments string after its object ended or broke: content


(
    OBJ_START, KEY_OR_END, KEY, COLON, VALUE_START, NAME, ARGS, ARGS_STR_PEEK, ARGS_STR_DECODE, SKIP, ARGS_STR_REST
) = CallPhase  # module-level names: the hot loops compare against globals


class CallOutcome(IntEnum):
    """What feed_call_object reports (never serialized)."""

    MORE = 0
    DONE = 1
    MALFORMED = 2
    ANGLE = 3


MORE, DONE, MALFORMED, ANGLE = CallOutcome  # module-level names: the hot loops compare against globals

MAX_KEY_CHARS = 64
# Text held while a call is not announced yet (arguments written before the name, envelope members): beyond
# this the object is not treated as a call.
MAX_UNANNOUNCED = 8192
_UNESCAPED_QUOTE = re.compile(r'["\\]')


class CallKeys(msgspec.Struct, frozen=True):
    """How a family spells its call object."""

    name: str = "name"
    # the object's first key is the call's name and its value the arguments ({"get_weather": {...}}, Apertus)
    name_is_key: bool = False
    # members that are the format's own, neither the call nor the model's text (Cohere's "tool_call_id")
    markup: tuple[str, ...] = ()
    # the call is announced only once its arguments key is read as well as its name
    announce_at_args: bool = False


CALL_KEYS = CallKeys()


class CallObject(msgspec.Struct, omit_defaults=True):
    phase: CallPhase = OBJ_START
    value_key: str = ""
    name: str = ""  # read, not necessarily announced
    name_emitted: bool = False
    args_started: bool = False
    pending_args: str = ""  # guarded arguments written before the name
    held_content: str = ""  # envelope members read before the call was announced
    str_hold: str = ""
    scan: JsonScan | None = None  # an envelope member being skipped
    guard: ArgsGuard | None = None

    def __post_init__(self) -> None:
        if len(self.pending_args) + len(self.held_content) > MAX_UNANNOUNCED + 2048 or len(self.str_hold) > 16:
            raise ValueError("inconsistent call object state")
        if self.name_emitted and not self.name:
            raise ValueError("inconsistent call object state: announced without a name")
        if (self.phase in (ARGS, ARGS_STR_DECODE)) and self.guard is None:
            raise ValueError("inconsistent call object state: arguments without their guard")


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


def _announce(obj: CallObject, sink: PieceSink, index: int) -> None:
    obj.name_emitted = True
    sink.name(index, obj.name)
    if obj.pending_args:
        sink.arguments(index, obj.pending_args)
        obj.pending_args = ""
    if obj.held_content:
        sink.content(obj.held_content)
        obj.held_content = ""


def _emit_args(obj: CallObject, sink: PieceSink, index: int, text: str) -> None:
    if not text:
        return
    if obj.name_emitted:
        sink.arguments(index, text)
    else:
        obj.pending_args += text


def _emit_content(obj: CallObject, sink: PieceSink, text: str) -> None:
    if not text:
        return
    if obj.name_emitted:
        sink.content(text)
    else:
        obj.held_content += text


def _start_args(obj: CallObject) -> None:
    obj.args_started = True
    obj.guard = ArgsGuard()


def _not_object_args(obj: CallObject, sink: PieceSink, index: int, quote: str) -> None:
    """Arguments that are not an object: the call gets ``{}``, the value (skipped as JSON) goes to content."""
    obj.args_started = True
    _emit_args(obj, sink, index, "{}")
    obj.scan = JsonScan(started=True, in_string=True) if quote else JsonScan()
    _emit_content(obj, sink, quote)
    obj.phase = SKIP


def _guard_args(
    obj: CallObject, sink: PieceSink, index: int, text: str, pos: int, end: int
) -> tuple[int, GuardStatus]:
    """Feed arguments text through the guard; (position, guard status). A broken object is closed."""
    stop, emitted, status = feed_guard(cast(ArgsGuard, obj.guard), text, pos, end)
    _emit_args(obj, sink, index, emitted)
    if status == GUARD_ERROR:
        _close_args(obj, sink, index)
    return stop, status


def _close_args(obj: CallObject, sink: PieceSink, index: int) -> None:
    if obj.guard is None:
        return
    closing, dropped = close_guard(obj.guard)
    _emit_args(obj, sink, index, closing)
    _emit_content(obj, sink, dropped)
    obj.guard = None


def unannounced_size(obj: CallObject) -> int:
    return len(obj.pending_args) + len(obj.held_content)


def finish_call_object(obj: CallObject, sink: PieceSink, index: int) -> bool:
    """The object ends here (the output ended, a closing tag, a syntax error). Completes the announced call's
    arguments: an open object is closed, arguments that never began are ``{}``. Returns False when there is no
    call (no name was read: the caller returns the object's text as content)."""
    if not obj.name_emitted:
        return False
    if not obj.args_started:
        obj.args_started = True
        sink.arguments(index, "{}")
    _close_args(obj, sink, index)
    return True


def feed_call_object(
    obj: CallObject,
    buf: str,
    pos: int,
    end: int,
    sink: PieceSink,
    index: int,
    arg_keys: tuple[str, ...],
    stop_at_angle: bool,
    keys: CallKeys = CALL_KEYS,
) -> tuple[int, int]:
    """Advance the call object over buf[pos:end]. Returns (position reached, outcome).

    MORE: everything up to ``end`` consumed except a short suffix the caller must hold back and feed again
    (returned position < end only when a key or name string is unfinished: those are re-read whole).
    DONE: the object closed just before the returned position (announced: ``obj.name_emitted``; an object
    without a name is not a call). MALFORMED: the text at the returned position cannot continue the object;
    if the call was announced its arguments are already closed. ANGLE: a ``<`` outside any string in the
    envelope at the returned position (the caller decides whether it starts a tag; if not, it feeds that one
    character again with stop_at_angle False).
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
                        obj.args_started = True
                        sink.arguments(index, "{}")
                    return i + 1, DONE
                if c != '"':
                    return i, MALFORMED
                obj.phase = KEY
                i += 1
            elif phase == COLON:
                if c != ":":
                    _emit_content(obj, sink, f'"{obj.value_key}"')  # a key without its value: the model's text
                    return i, MALFORMED
                obj.phase = VALUE_START
                i += 1
            else:
                key = obj.value_key
                if key == keys.name and not obj.name:
                    if c != '"':
                        return i, MALFORMED
                    obj.phase = NAME
                    i += 1
                elif key in arg_keys and not obj.args_started:
                    if obj.name and not obj.name_emitted:
                        _announce(obj, sink, index)  # announce_at_args: the name was read, now its arguments
                    if c == '"':
                        obj.phase = ARGS_STR_PEEK
                        i += 1
                    elif c == "{":
                        _start_args(obj)
                        obj.phase = ARGS
                    elif obj.name_emitted:
                        _not_object_args(obj, sink, index, "")
                    else:
                        return i, MALFORMED  # non-object arguments before any name: not a call
                else:
                    obj.scan = JsonScan()
                    obj.phase = SKIP
                    if key not in keys.markup:
                        _emit_content(obj, sink, f'"{key}": ')
        elif phase == KEY or phase == NAME:
            q = _read_string(buf, i, end)
            if q == -1:
                # an unfinished key or name is re-read whole next time (both are short)
                if end - i > (MAX_KEY_CHARS if phase == KEY else MAX_NAME_CHARS):
                    return i, MALFORMED
                return i, MORE
            raw = buf[i:q]
            i = q + 1
            if phase == KEY and keys.name_is_key and not obj.name:
                try:
                    name = decode_json_string_body(raw)
                except ValueError:
                    return q, MALFORMED
                if not name.strip() or len(name) > MAX_NAME_CHARS:
                    return q, MALFORMED
                obj.name = name
                _announce(obj, sink, index)
                obj.value_key = arg_keys[0]  # its value is the arguments
                obj.phase = COLON
            elif phase == KEY:
                obj.value_key = raw if len(raw) <= MAX_KEY_CHARS else ""
                obj.phase = COLON
            else:
                try:
                    name = decode_json_string_body(raw)
                except ValueError:
                    return q, MALFORMED
                if not name.strip() or len(name) > MAX_NAME_CHARS:
                    return q, MALFORMED
                obj.name = name
                if not keys.announce_at_args or obj.args_started:
                    _announce(obj, sink, index)
                obj.phase = KEY_OR_END
        elif phase == ARGS:
            stop, emitted, status = feed_guard(cast(ArgsGuard, obj.guard), buf, i, end)  # set with the phase
            if emitted:
                if obj.name_emitted:
                    sink.arguments(index, emitted)
                else:
                    obj.pending_args += emitted
            if status == GUARD_ERROR:
                _close_args(obj, sink, index)
            i = stop
            if status == GUARD_DONE:
                obj.guard = None
                obj.phase = KEY_OR_END
            elif status == GUARD_ERROR:
                return i, MALFORMED
        elif phase == SKIP:
            scan = obj.scan if obj.scan is not None else JsonScan()
            obj.scan = scan
            stop = scan_json_value(scan, buf, i, end, stop_at_angle)
            if obj.value_key not in keys.markup:
                _emit_content(obj, sink, buf[i:stop])
            i = stop
            if scan.done:
                obj.scan = None
                obj.phase = KEY_OR_END
            elif i < end:
                return i, ANGLE
        elif phase == ARGS_STR_PEEK:
            if buf[i] == "{":
                _start_args(obj)
                obj.phase = ARGS_STR_DECODE
            elif buf[i] == '"':
                # "arguments": "" is a call without arguments
                obj.args_started = True
                _emit_args(obj, sink, index, "{}")
                obj.phase = KEY_OR_END
                i += 1
            elif obj.name_emitted:
                _not_object_args(obj, sink, index, '"')  # a plain string: its text is content
            else:
                return i, MALFORMED
        else:  # ARGS_STR_DECODE / ARGS_STR_REST: arguments serialised as a string holding JSON, decoded once
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
            try:
                decoded = decode_json_string_body(body)
            except ValueError:
                decoded = body  # an invalid escape: the text as written
            if phase == ARGS_STR_REST:
                _emit_content(obj, sink, decoded)
            else:
                stop, status = _guard_args(obj, sink, index, decoded, 0, len(decoded))
                if status != GUARD_MORE:
                    if status == GUARD_DONE:
                        obj.guard = None
                    _emit_content(obj, sink, decoded[stop:])
                    obj.phase = ARGS_STR_REST
            if q != -1:
                if obj.phase == ARGS_STR_DECODE:
                    _close_args(obj, sink, index)  # the string ended before its object did
                obj.phase = KEY_OR_END
    return end, MORE
