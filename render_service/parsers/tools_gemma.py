"""Gemma's call syntax, ``call:NAME{key:<|"|>text<|"|>,n:42,flag:true,obj:{k:v},list:[1,2]}``, read into JSON
arguments as it streams; the markers around each call are ``tools_wrapped``'s (a family is a declaration):

* ``gemma4`` (Gemma 4): ``<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>``, strings between
  ``<|"|>`` (kept verbatim), bare values typed as upstream's ``_parse_gemma4_value`` types them (``true``,
  ``false``, an int, a float when there is a ``.``, else the text as a string).
* ``functiongemma`` (FunctionGemma): ``<start_function_call>call:NAME{key:<escape>v<escape>}<end_function_call>``;
  a delimited value is read as JSON when it parses (``3`` is a number), else it is the string.

Keys are unquoted and end at ``:``; string values stream as they arrive (JSON-escaped), other values when they
end. Text after a call's closing brace, and a block that does not read as ``call:NAME{``, is content. A key
that runs into ``{``/``}``/``[``/``]`` before its ``:`` breaks the call off: its arguments are closed and the
rest of the block is content. The end of a block closes whatever the call left open.
"""

from __future__ import annotations

import json
import math
import re
from enum import IntEnum
from typing import Any, ClassVar

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.json_scan import dumps, json_string_fragment
from render_service.parsers.tags import partial_tag_len
from render_service.parsers.tools_common import MAX_NAME_CHARS, Count, HeldTextToolParser, PieceSink, require
from render_service.parsers.tools_wrapped import WrappedToolParser


class GemmaMode(IntEnum):
    """Where a call is. Travels in stream_state as its int."""

    HEAD = 0  # expecting call:NAME{
    KEY = 1
    VALUE = 2
    STRING = 3  # inside a delimited string, streamed
    BARE = 4  # a bare value, held to its end
    AFTER = 5  # after a value: , } ] or the next key
    REST = 6  # the rest of the block is content
    HELD_STRING = 7  # a delimited value read as JSON at its end (functiongemma)


HEAD, KEY, VALUE, STRING, BARE, AFTER, REST, HELD_STRING = GemmaMode

_HEAD = "call:"
_NAME = re.compile(r"[\w\-.]*")
_KEY_STOP = re.compile(r"[:{}\[\]]")
_BARE_STOP = re.compile(r"[,}\]]")
_SKIP_KEY = " ,\n\t\r"
_SPACE = " \n\t\r"
_CLOSER = {"{": "}", "[": "]"}


def bare_value(raw: str) -> Any:
    """A bare value as upstream types it; a number JSON cannot carry stays its text."""
    s = raw.strip()
    if s in ("true", "false"):
        return s == "true"
    try:
        number: float = float(s) if "." in s else int(s)
    except ValueError:
        return s
    return number if math.isfinite(number) else s


def _no_constants(name: str) -> Any:
    raise ValueError(name)


def held_string_value(raw: str) -> Any:
    """A functiongemma value: JSON when it parses (upstream's json.loads), else the text."""
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except ValueError:
        return raw


class GemmaCallState(msgspec.Struct, omit_defaults=True):
    mode: GemmaMode = HEAD
    held: str = ""
    stack: str = ""  # the open containers, "{" and "[" (the arguments' own "{" first)
    first: bool = True  # the innermost container has no element yet
    calls: Count = 0  # calls started in this block

    def __post_init__(self) -> None:
        require(set(self.stack) <= {"{", "["}, "containers are { or [")
        require(bool(self.stack) == (self.mode not in (HEAD, REST)), "containers open only inside a call")


class GemmaCallsParser(HeldTextToolParser):
    """``call:NAME{...}`` calls (one block of them); ``DELIM`` quotes strings."""

    name: ClassVar[str] = "gemma_calls"
    State: ClassVar[type[msgspec.Struct]] = GemmaCallState
    DELIM: ClassVar[str] = '<|"|>'
    JSON_STRINGS: ClassVar[bool] = False  # a delimited value is JSON when it parses

    def _emit_value(self, state: GemmaCallState, sink: PieceSink, text: str) -> None:
        sink.arguments(state.calls, text)
        state.mode = AFTER

    def _open(self, state: GemmaCallState, sink: PieceSink, bracket: str) -> None:
        sink.arguments(state.calls, bracket)
        state.stack += bracket
        state.first = True
        state.mode = KEY if bracket == "{" else VALUE

    def _close(self, state: GemmaCallState, sink: PieceSink) -> None:
        sink.arguments(state.calls, _CLOSER[state.stack[-1]])
        state.stack = state.stack[:-1]
        state.first = False
        if state.stack:
            state.mode = AFTER
        else:
            state.calls += 1
            state.mode = HEAD

    def _close_all(self, state: GemmaCallState, sink: PieceSink) -> None:
        if state.stack:
            sink.arguments(state.calls, "".join(_CLOSER[b] for b in reversed(state.stack)))
            state.stack = ""
            state.calls += 1

    def _run(self, state: GemmaCallState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        delim = self.DELIM
        while pos < n:
            mode = state.mode
            if mode == REST:
                sink.content(buf[pos:])
                return
            if mode == HEAD:
                rest = buf[pos:]
                if len(rest) <= len(_HEAD):
                    if _HEAD.startswith(rest):
                        state.held = rest
                        return
                    state.mode = REST
                    continue
                if not rest.startswith(_HEAD):
                    state.mode = REST
                    continue
                end = _NAME.match(buf, pos + len(_HEAD)).end()  # type: ignore[union-attr]
                if end == n:
                    if end - pos > MAX_NAME_CHARS:
                        state.mode = REST
                        continue
                    state.held = rest
                    return
                if buf[end] != "{" or end == pos + len(_HEAD):
                    state.mode = REST
                    continue
                sink.name(state.calls, buf[pos + len(_HEAD):end])
                self._open(state, sink, "{")
                pos = end + 1
            elif mode == KEY:
                while pos < n and buf[pos] in _SKIP_KEY:
                    pos += 1
                if pos == n:
                    return
                if buf[pos] in "}]":
                    self._close(state, sink)
                    pos += 1
                    continue
                m = _KEY_STOP.search(buf, pos)
                if m is None:
                    if n - pos > MAX_NAME_CHARS:
                        self._break_off(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                if m.group() != ":":
                    self._break_off(state, sink)
                    continue
                sep = "" if state.first else ", "
                sink.arguments(state.calls, sep + dumps(buf[pos:m.start()].strip()) + ": ")
                state.first = False
                state.mode = VALUE
                pos = m.end()
            elif mode == VALUE:
                while pos < n and buf[pos] in _SPACE:
                    pos += 1
                if pos == n:
                    return
                c = buf[pos]
                in_list = state.stack[-1] == "["
                if in_list and c in ",]}":
                    if c == ",":
                        pos += 1
                    else:
                        self._close(state, sink)
                        pos += 1
                    continue
                if not in_list and c in ",}]":
                    self._emit_value(state, sink, '""')  # a key without a value: upstream's ""
                    continue
                if buf.startswith(delim[: n - pos], pos) and n - pos < len(delim):
                    state.held = buf[pos:]  # a partial delimiter
                    return
                if in_list:
                    if not state.first:
                        sink.arguments(state.calls, ", ")
                    state.first = False
                if buf.startswith(delim, pos):
                    pos += len(delim)
                    if self.JSON_STRINGS:
                        state.mode = HELD_STRING
                    else:
                        sink.arguments(state.calls, '"')
                        state.mode = STRING
                elif c in "{[":
                    self._open(state, sink, c)
                    pos += 1
                else:
                    state.mode = BARE
            elif mode == STRING:
                j = buf.find(delim, pos)
                if j == -1:
                    safe = n - partial_tag_len(buf, pos, (delim,))
                    sink.arguments(state.calls, json_string_fragment(buf[pos:safe]))
                    state.held = buf[safe:]
                    return
                self._emit_value(state, sink, json_string_fragment(buf[pos:j]) + '"')
                pos = j + len(delim)
            elif mode == HELD_STRING:
                j = buf.find(delim, pos)
                if j == -1:
                    state.held = buf[pos:]
                    return
                self._emit_value(state, sink, dumps(held_string_value(buf[pos:j])))
                pos = j + len(delim)
            elif mode == BARE:
                m = _BARE_STOP.search(buf, pos)
                if m is None:
                    state.held = buf[pos:]
                    return
                self._emit_value(state, sink, dumps(bare_value(buf[pos:m.start()])))
                pos = m.start()
            else:  # AFTER
                while pos < n and buf[pos] in _SPACE:
                    pos += 1
                if pos == n:
                    return
                c = buf[pos]
                if c in "}]":
                    self._close(state, sink)
                    pos += 1
                elif c == ",":
                    state.mode = KEY if state.stack[-1] == "{" else VALUE
                    pos += 1
                else:  # no comma: the next key or element all the same
                    state.mode = KEY if state.stack[-1] == "{" else VALUE

    def _break_off(self, state: GemmaCallState, sink: PieceSink) -> None:
        self._close_all(state, sink)
        state.mode = REST

    def finish(self, state: GemmaCallState) -> list[Piece]:
        sink = PieceSink()
        held, state.held = state.held, ""
        mode = state.mode
        if mode == STRING:
            sink.arguments(state.calls, json_string_fragment(held) + '"')
        elif mode == HELD_STRING:
            sink.arguments(state.calls, dumps(held_string_value(held)))
        elif mode == BARE or (mode == VALUE and held):
            sink.arguments(state.calls, dumps(bare_value(held)))
        elif mode == VALUE and state.stack[-1] == "{":
            sink.arguments(state.calls, '""')
        self._close_all(state, sink)
        if mode in (HEAD, KEY, REST):
            sink.content(held)  # a name or key that never ended is the model's text
        state.mode = HEAD
        return sink.pieces


class Gemma4CallsParser(GemmaCallsParser):
    name: ClassVar[str] = "gemma4_calls"


class FunctionGemmaCallsParser(GemmaCallsParser):
    name: ClassVar[str] = "functiongemma_calls"
    DELIM: ClassVar[str] = "<escape>"
    JSON_STRINGS: ClassVar[bool] = True


class Gemma4ToolParser(WrappedToolParser):
    name: ClassVar[str] = "gemma4"
    START: ClassVar[str] = "<|tool_call>"
    END: ClassVar[str | None] = "<tool_call|>"
    INNER: ClassVar[Any] = Gemma4CallsParser


class FunctionGemmaToolParser(WrappedToolParser):
    name: ClassVar[str] = "functiongemma"
    START: ClassVar[str] = "<start_function_call>"
    END: ClassVar[str | None] = "<end_function_call>"
    INNER: ClassVar[Any] = FunctionGemmaCallsParser
