"""Arguments that stream as the model's own JSON text, guarded so that what goes out is always valid.

The JSON-text families (hermes, llama3_json, mistral, deepseek_v31, kimi_k2) stream a call's ``arguments`` as
the model's bytes. A model can write anything there: a syntax error, or an object cut off by ``max_tokens``.
``feed_guard`` passes the text through a small pushdown validator and emits only what is known to extend a
valid JSON object; ``close_guard`` returns the few characters that complete what was emitted (an open
string's quote, the open containers' closers). So at the end every call's arguments parse as a JSON object and
equal the concatenated deltas, whatever the model wrote.

What is held back (bounded): a member's head (``, "key":``) until its value begins, a number or literal until
it ends (``tr`` may yet be ``true``; ``1.`` is not a number), an escape sequence until it is complete.
Repairs that keep the model's characters: a raw control character inside a string goes out escaped
(``\\n``), an invalid escape's backslash goes out doubled, a trailing comma before a closer is dropped.
At the first character that cannot continue the object the guard stops (``GUARD_ERROR``): the caller closes the
arguments and hands the rest of the text, and what the guard dropped, to content.
"""

from __future__ import annotations

import re
from enum import IntEnum

import msgspec

from render_service.parsers.tools_common import WHITESPACE

MAX_DEPTH = 128
MAX_HELD = 1024  # a member head (key) or a scalar longer than this is not one the guard will hold


class GuardPhase(IntEnum):
    """Where the validator is. Travels in stream_state as its int."""

    START = 0  # before the object's "{"
    MEMBER = 1  # after "{" or ",": a key (or "}" right after "{")
    KEY = 2  # inside a key string
    COLON = 3
    VALUE = 4  # a value (after ":", "[" or "," in an array)
    STRING = 5  # inside a string value
    SCALAR = 6  # inside a number or literal
    AFTER = 7  # after a value: "," or a closer
    DONE = 8


START, MEMBER, KEY, COLON, VALUE, STRING, SCALAR, AFTER, DONE = GuardPhase


class GuardStatus(IntEnum):
    """What feed_guard reports (never serialized)."""

    GUARD_MORE = 0
    GUARD_DONE = 1
    GUARD_ERROR = 2


GUARD_MORE, GUARD_DONE, GUARD_ERROR = GuardStatus


class ArgsGuard(msgspec.Struct, omit_defaults=True):
    phase: GuardPhase = START
    stack: str = ""  # open containers, "{" or "["
    first: bool = False  # right after an opener: a closer is allowed, a value or key is not required
    pending: str = ""  # validated text not emitted yet (member head, scalar)
    scalar_at: int = 0  # where the scalar starts in pending
    esc: str = ""  # an unfinished escape sequence inside a string (or key)
    failed: bool = False

    def __post_init__(self) -> None:
        # a client-sent state (stream_state) that decodes must never make feed_guard raise
        if (len(self.stack) > MAX_DEPTH or len(self.pending) > MAX_HELD + 8 or len(self.esc) > 6
                or self.stack.strip("{[") or self.scalar_at > len(self.pending)
                or (self.phase in (START, DONE)) != (not self.stack)):
            raise ValueError("inconsistent arguments guard state")


_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_CONTROL_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
_CLOSER = {"{": "}", "[": "]"}


def _string_body(g: ArgsGuard, buf: str, pos: int, end: int, out: list[str]) -> tuple[int, bool]:
    """Advance inside a string (value or key) over buf[pos:end]; text goes to ``out``.

    Returns (position, closed): closed when the closing quote was consumed (it is not written to ``out``).
    An escape sequence cut by the chunk's end waits in ``g.esc`` and is re-read in front of the next chunk.
    """
    if not g.esc:
        return _string_scan(g, buf, pos, end, out)
    text, shift = g.esc + buf[pos:end], len(g.esc)
    g.esc = ""
    k, closed = _string_scan(g, text, 0, len(text), out)
    return pos + max(k - shift, 0), closed


def _string_scan(g: ArgsGuard, buf: str, pos: int, end: int, out: list[str]) -> tuple[int, bool]:
    i = pos
    while i < end:
        m = _STRING_SPECIAL.search(buf, i, end)
        if m is None:
            out.append(buf[i:end])
            return end, False
        j = m.start()
        if j > i:
            out.append(buf[i:j])
        c = buf[j]
        if c == '"':
            return j + 1, True
        if c != "\\":
            out.append(_CONTROL_ESCAPES.get(c) or f"\\u{ord(c):04x}")  # a raw control character: escaped
            i = j + 1
            continue
        if j + 1 >= end:
            g.esc = "\\"
            return end, False
        if buf[j + 1] == "u":
            seq = buf[j:j + 6]
            if len(seq) < 6 and all(h in _HEX for h in seq[2:]):
                g.esc = seq
                return end, False
            out.append(_checked_escape(seq))
            i = j + len(seq) if len(seq) == 6 and all(h in _HEX for h in seq[2:]) else j + 1
            continue
        out.append(_checked_escape(buf[j:j + 2]))
        i = j + 2
    return i, False


def _checked_escape(seq: str) -> str:
    """A complete escape sequence as valid JSON: itself, or (invalid) its backslash doubled."""
    if len(seq) == 2 and seq[1] in _SIMPLE_ESCAPES:
        return seq
    if len(seq) == 6 and seq[1] == "u" and all(h in _HEX for h in seq[2:]):
        return seq
    return "\\\\" + seq[1:2] if len(seq) == 2 else "\\\\"  # "\\u12zz": the backslash doubled, the rest plain


def _put(g: ArgsGuard, out: list[str], text: str) -> None:
    if g.pending:
        g.pending += text
    else:
        out.append(text)


def _commit(g: ArgsGuard, out: list[str], text: str) -> None:
    """A value begins (or a scalar ended): the held member head goes out with it."""
    if g.pending:
        out.append(g.pending)
        g.pending = ""
    out.append(text)


def _after_value(g: ArgsGuard) -> None:
    g.phase = AFTER if g.stack else DONE


def feed_guard(g: ArgsGuard, buf: str, pos: int, end: int) -> tuple[int, str, GuardStatus]:
    """Advance over buf[pos:end]. Returns (position, text to emit, status).

    GUARD_MORE: everything up to ``end`` consumed. GUARD_DONE: the object closed just before the position.
    GUARD_ERROR: buf[position] cannot continue the object (not consumed); ``close_guard`` completes it.
    """
    if g.phase == STRING and not g.esc:
        # the hot path: a chunk of string text with nothing special in it streams as it is
        m = _STRING_SPECIAL.search(buf, pos, end)
        if m is None:
            return end, buf[pos:end], GUARD_MORE
    if g.failed:
        return pos, "", GUARD_ERROR
    out: list[str] = []
    i = pos
    while i < end:
        phase = g.phase
        if phase == STRING or phase == KEY:
            target: list[str] = out if phase == STRING else []
            i, closed = _string_body(g, buf, i, end, target)
            if phase == KEY:
                g.pending += "".join(target)
                if len(g.pending) > MAX_HELD:
                    g.failed = True
                    return i, "".join(out), GUARD_ERROR
            if closed:
                if phase == STRING:
                    out.append('"')
                    _after_value(g)
                else:
                    g.pending += '"'
                    g.phase = COLON
            continue
        c = buf[i]
        if phase == SCALAR:
            if c in _SCALAR_CHARS:
                g.pending += c
                i += 1
                if len(g.pending) - g.scalar_at > MAX_HELD:
                    g.failed = True
                    return i, "".join(out), GUARD_ERROR
                continue
            if _SCALAR.fullmatch(g.pending, g.scalar_at) is None:
                g.failed = True
                return i, "".join(out), GUARD_ERROR
            out.append(g.pending)
            g.pending, g.scalar_at = "", 0
            _after_value(g)
            continue
        if phase == DONE:
            return i, "".join(out), GUARD_DONE
        if c in WHITESPACE:
            _put(g, out, c)
            i += 1
            continue
        if phase == START:
            if c != "{":
                g.failed = True
                return i, "".join(out), GUARD_ERROR
            out.append(c)
            g.stack, g.phase, g.first = "{", MEMBER, True
        elif phase == MEMBER or phase == VALUE:
            top = g.stack[-1]
            if c in "}]" and _CLOSER[top] == c and (g.first or g.pending.strip(WHITESPACE) == ","):
                g.pending = ""  # a trailing comma before the closer is dropped
                out.append(c)
                g.stack = g.stack[:-1]
                g.first = False
                _after_value(g)
            elif phase == MEMBER:
                if c != '"':
                    g.failed = True
                    return i, "".join(out), GUARD_ERROR
                g.pending += '"'
                g.phase = KEY
            elif c == '"':
                _commit(g, out, c)
                g.phase = STRING
            elif c in "{[":
                if len(g.stack) >= MAX_DEPTH:
                    g.failed = True
                    return i, "".join(out), GUARD_ERROR
                _commit(g, out, c)
                g.stack += c
                g.phase = MEMBER if c == "{" else VALUE
                g.first = True
                i += 1
                continue
            elif c in "-0123456789tfn":
                g.scalar_at = len(g.pending)
                g.pending += c
                g.phase = SCALAR
            else:
                g.failed = True
                return i, "".join(out), GUARD_ERROR
            g.first = False
        elif phase == COLON:
            if c != ":":
                g.failed = True
                return i, "".join(out), GUARD_ERROR
            g.pending += c
            g.phase = VALUE
        else:  # AFTER
            top = g.stack[-1]
            if c == ",":
                g.pending = ","
                g.phase = MEMBER if top == "{" else VALUE
            elif c == _CLOSER[top]:
                out.append(c)
                g.stack = g.stack[:-1]
                _after_value(g)
            else:
                g.failed = True
                return i, "".join(out), GUARD_ERROR
        i += 1
    if g.phase == DONE:
        return i, "".join(out), GUARD_DONE
    return i, "".join(out), GUARD_MORE


def close_guard(g: ArgsGuard) -> tuple[str, str]:
    """(text that completes the emitted arguments into a JSON object, model text the guard consumed but did
    not emit). Leaves the guard DONE."""
    closing, dropped = "", ""
    if g.phase == START:
        closing = "{}"
    elif g.phase == STRING:
        dropped = g.esc
        closing = '"'
    elif g.phase == SCALAR and not g.failed and _SCALAR.fullmatch(g.pending, g.scalar_at) is not None:
        closing = g.pending  # a number or literal the output ended on is complete
    else:
        dropped = g.pending + g.esc
    if not dropped.strip(WHITESPACE + ","):
        dropped = ""  # a lone comma or layout is markup
    closing += "".join(_CLOSER[c] for c in reversed(g.stack))
    g.phase, g.stack, g.pending, g.esc, g.scalar_at, g.first = DONE, "", "", "", 0, False
    return closing, dropped
