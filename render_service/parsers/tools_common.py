"""Shared machinery for the tool-call parsers: piece collection, tag hold-back, incremental JSON scanning.

Every parser here works the same way: ``feed`` prepends the state's held-back suffix to the new text, walks
the result once from left to right, and stores back only what it cannot decide yet (a possible partial tag,
an incomplete escape, a short name). Nothing ever looks at text that was already consumed, so the work per
feed is O(new text + held-back suffix) however long a call's arguments grow.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, ClassVar

import msgspec

from render_service.parsers.base import Piece, TextPiece, ToolCallPiece, ToolParserConfig, ToolSpec

WHITESPACE = " \t\r\n"

# Names are short; a "name" that keeps growing without its terminator is not a name.
MAX_NAME_CHARS = 256

# State fields arrive from clients (stream_state): counters and modes are range-checked on decode.
Count = Annotated[int, msgspec.Meta(ge=0)]


def mode_field(n_modes: int):
    return Annotated[int, msgspec.Meta(ge=0, lt=n_modes)]


def require(condition: bool, what: str) -> None:
    """Cross-field checks in a state's __post_init__ (msgspec reports them as ValidationError)."""
    if not condition:
        raise ValueError(f"inconsistent tool parser state: {what}")


class PieceSink:
    """Collects pieces, merging adjacent content runs and adjacent argument fragments of one call."""

    __slots__ = ("pieces",)

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def content(self, text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, TextPiece):
            self.pieces[-1] = TextPiece(channel="content", text=last.text + text)
        else:
            self.pieces.append(TextPiece(channel="content", text=text))

    def name(self, index: int, name: str, call_id: str | None = None) -> None:
        self.pieces.append(ToolCallPiece(index=index, name=name, id=call_id))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, ToolCallPiece) and last.index == index:
            merged = (last.arguments or "") + text
            self.pieces[-1] = msgspec.structs.replace(last, arguments=merged)
        else:
            self.pieces.append(ToolCallPiece(index=index, arguments=text))


# ---------------------------------------------------------------------------------------------------------
# Tag search with hold-back


@functools.lru_cache(maxsize=64)
def _partial_tag_pattern(tags: tuple[str, ...]) -> tuple[re.Pattern, int]:
    # every proper prefix of every tag, anchored at the end of the text; the leftmost match is the longest
    prefixes = {t[:k] for t in tags for k in range(1, len(t))}
    alternation = "|".join(re.escape(p) for p in sorted(prefixes, key=len, reverse=True))
    return re.compile(f"(?:{alternation})\\Z"), max(len(t) for t in tags) - 1


def partial_tag_len(buf: str, start: int, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf[start:] that is a proper prefix of one of ``tags``."""
    pattern, longest = _partial_tag_pattern(tags)
    m = pattern.search(buf, max(start, len(buf) - longest))
    return len(buf) - m.start() if m else 0


def find_tag(buf: str, start: int, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest complete tag at or after ``start``: (its position, the tag).

    When there is none: (the end of the text that is certainly not part of a tag, None); the rest may be
    the beginning of a tag and must be held back.
    """
    best, best_tag = -1, None
    for tag in tags:
        i = buf.find(tag, start)
        if i != -1 and (best == -1 or i < best or (i == best and len(tag) > len(best_tag))):
            best, best_tag = i, tag
    if best_tag is not None:
        return best, best_tag
    return len(buf) - partial_tag_len(buf, start, tags), None


def skip_whitespace(buf: str, pos: int) -> int:
    n = len(buf)
    while pos < n and buf[pos] in WHITESPACE:
        pos += 1
    return pos


def is_partial_tag(fragment: str, tags: tuple[str, ...]) -> bool:
    """True when ``fragment`` (the rest of the text) could still grow into one of ``tags``."""
    return any(len(fragment) < len(t) and t.startswith(fragment) for t in tags)


# ---------------------------------------------------------------------------------------------------------
# Incremental JSON value scanning: where does a value end, without parsing it


class JsonScan(msgspec.Struct):
    """Just enough to know where a JSON value ends: nesting depth and in-string/escape flags."""

    started: bool = False
    depth: Count = 0
    in_string: bool = False
    escape: bool = False
    primitive: bool = False
    done: bool = False


_IN_STRING = re.compile(r'["\\]')
_STRUCTURAL = re.compile(r'["{}\[\]<]')
_PRIMITIVE_END = re.compile(r"[\s,}\]<]")


def scan_json_value(scan: JsonScan, buf: str, pos: int, end: int, stop_at_angle: bool) -> int:
    """Advance over buf[pos:end], which continues the value ``scan`` tracks; the value's first character
    must not be whitespace.

    Returns where scanning stopped: just past the value when it ended (``scan.done``), ``end`` when more
    text is needed, or the index of a ``<`` outside any string when ``stop_at_angle`` (it may start a
    closing tag; JSON never has one there). A primitive (number, true, ...) ends before its delimiter.
    """
    i = pos
    while i < end:
        if scan.in_string:
            if scan.escape:
                scan.escape = False
                i += 1
                continue
            m = _IN_STRING.search(buf, i, end)
            if m is None:
                return end
            i = m.start()
            if buf[i] == "\\":
                scan.escape = True
                i += 1
                continue
            scan.in_string = False
            i += 1
            if scan.depth == 0:
                scan.done = True
                return i
            continue
        if not scan.started:
            scan.started = True
            c = buf[i]
            if c in "{[":
                scan.depth = 1
                i += 1
            elif c == '"':
                scan.in_string = True
                i += 1
            else:
                scan.primitive = True
            continue
        if scan.primitive:
            m = _PRIMITIVE_END.search(buf, i, end)
            if m is None:
                return end
            if buf[m.start()] == "<" and not stop_at_angle:
                i = m.start() + 1
                continue
            scan.done = True
            return m.start()
        m = _STRUCTURAL.search(buf, i, end)
        if m is None:
            return end
        i = m.start()
        c = buf[i]
        if c == '"':
            scan.in_string = True
        elif c in "{[":
            scan.depth += 1
        elif c in "}]":
            scan.depth -= 1
            if scan.depth == 0:
                scan.done = True
                return i + 1
        elif stop_at_angle:
            return i
        i += 1
    return end


def finish_primitive(scan: JsonScan) -> None:
    """At the end of output a primitive has nothing more to wait for."""
    if scan.primitive:
        scan.done = True


# ---------------------------------------------------------------------------------------------------------
# Incremental decoding of a JSON string body (for arguments that arrive serialised as a string)

_HEX = frozenset("0123456789abcdefABCDEF")


def json_string_safe_end(raw: str) -> int:
    """End of the longest prefix of a JSON string body that does not stop inside an escape sequence, or
    between the two halves of a surrogate pair."""
    i = raw.rfind("\\")
    if i == -1:
        return len(raw)
    # count the backslash run ending at i: an even run is complete escapes only
    j = i
    while j > 0 and raw[j - 1] == "\\":
        j -= 1
    run = i - j + 1
    if run % 2 == 0:
        return len(raw)
    tail = raw[i + 1 :]
    if not tail:
        return i
    if tail[0] != "u":
        return len(raw)
    if len(tail) < 5 or not all(c in _HEX for c in tail[1:5]):
        return i if len(tail) < 5 else len(raw)
    code = int(tail[1:5], 16)
    if 0xD800 <= code <= 0xDBFF and len(tail) == 5:
        return i  # a high surrogate waits for its low half
    return len(raw)


def decode_json_string_body(raw: str) -> str:
    return json.loads('"' + raw + '"')


def json_string_fragment(text: str) -> str:
    """JSON string escaping of ``text`` without the quotes; escaping is per character, so fragments of a
    string escaped one by one concatenate to the escaping of the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def dumps(value: object) -> str:
    """How we serialise a converted value: vLLM's json.dumps(ensure_ascii=False) spacing."""
    return json.dumps(value, ensure_ascii=False)


def tools_by_name(tools: list[ToolSpec]) -> dict[str, ToolSpec]:
    return {t.name: t for t in tools}


# ---------------------------------------------------------------------------------------------------------
# A call written as a JSON object: {"name": "f", "arguments": {...}} (hermes, llama3_json, mistral pre-v11)

OBJ_START, KEY_OR_END, KEY, COLON, VALUE_START, NAME, ARGS, ARGS_STR_PEEK, ARGS_STR_DECODE, SKIP = range(10)

# feed_call_object outcomes
MORE, DONE, MALFORMED, ANGLE = range(4)

MAX_KEY_CHARS = 64
_UNESCAPED_QUOTE = re.compile(r'["\\]')


class CallObject(msgspec.Struct):
    """Progress through one call object. The arguments value is streamed as the model's raw text; only the
    name (and arguments that arrive before the name, which is rare) is held."""

    phase: Annotated[int, msgspec.Meta(ge=0, le=SKIP)] = OBJ_START
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


# ---------------------------------------------------------------------------------------------------------
# Calls framed by special-token markers: section begin, (call begin, name, separator, arguments, call end)*,
# section end (deepseek_v31, kimi_k2). Arguments are the model's raw text between separator and call end.

SEC_CONTENT, SEC_SECTION, SEC_NAME, SEC_ARGS = range(4)


class SectionedState(msgspec.Struct):
    mode: Annotated[int, msgspec.Meta(ge=0, le=SEC_ARGS)] = SEC_CONTENT
    held: str = ""
    calls: Count = 0
    args_started: bool = False


class HeldTextToolParser:
    """Base for the parsers here: ``feed`` prepends the held-back suffix and hands the text to ``_run``."""

    name: ClassVar[str]
    State: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: ToolParserConfig) -> None:
        self.config = config

    def initial_state(self) -> msgspec.Struct:
        return self.State()

    def feed(self, state, text: str) -> list[Piece]:
        sink = PieceSink()
        buf = state.held + text
        state.held = ""
        self._run(state, buf, sink)
        return sink.pieces


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

    def _end_call(self, state: SectionedState, sink: PieceSink, next_mode: int) -> None:
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
