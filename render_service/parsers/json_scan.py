"""Incremental JSON, without parsing it: where a streamed value ends (``scan_json_value``), and the pieces
of JSON string handling the tool parsers stream with (safe cut points, fragment escaping, vLLM's dumps).
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring

import msgspec

from render_service.parsers.tools_common import Count


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
    decoded: str = json.loads('"' + raw + '"')
    return decoded


def json_string_fragment(text: str) -> str:
    """JSON string escaping of ``text`` without the quotes; escaping is per character, so fragments of a
    string escaped one by one concatenate to the escaping of the whole. (json.dumps(text, ensure_ascii=False)
    gives the same, but builds an encoder on every call: this runs per streamed token.)"""
    return encode_basestring(text)[1:-1]


def dumps(value: object) -> str:
    """How we serialise a converted value: vLLM's json.dumps(ensure_ascii=False) spacing."""
    return json.dumps(value, ensure_ascii=False)
