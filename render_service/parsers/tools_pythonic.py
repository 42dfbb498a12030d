"""pythonic (Llama 3.2 / 4, ToolACE): a Python list of calls with keyword arguments written as literals,
``[get_weather(city='Paris', days=3), get_time()]``.

Tool mode is decided by the start of the output (``[``, leading whitespace allowed), as in vLLM's streaming
parser; otherwise everything is content. Arguments become ``json.dumps(dict, ensure_ascii=False)`` of the
literal values, streamed in order: string values as they arrive (decoded from Python escapes and re-escaped
for JSON), other literals when complete (they go through ``ast.literal_eval``). A literal JSON cannot carry
(``1e999``, ``b'x'``, a set, a name) becomes its source text, as a string, so no call is lost and arguments
are always JSON. A call that breaks off (a positional argument, a syntax error) or is cut by the end of output
is closed; text after the list, and after a call that broke off, is content.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from enum import IntEnum
from typing import ClassVar, Literal

import msgspec

from render_service.parsers.base import Piece
from render_service.parsers.json_scan import dumps, json_string_fragment
from render_service.parsers.tags import skip_whitespace
from render_service.parsers.tool_schema import json_safe
from render_service.parsers.tools_common import MAX_NAME_CHARS, Count, HeldTextToolParser, PieceSink


class PythonicMode(IntEnum):
    """Where a pythonic ``[f(a=1), g()]`` stream is. Travels in stream_state as its int."""

    START = 0
    LIST_ITEM = 1
    NAME = 2
    ARGS = 3
    KEYWORD = 4
    VALUE_START = 5
    STR_VALUE = 6
    BUF_VALUE = 7
    AFTER_VALUE = 8
    AFTER_CALL = 9
    CONTENT_ONLY = 10
    DROP = 11  # no longer entered (the rest is content); a state that has it reads as CONTENT_ONLY
    AFTER_LIST = 12  # after "]": whitespace is layout, the rest is content


(
    START, LIST_ITEM, NAME, ARGS, KEYWORD, VALUE_START, STR_VALUE, BUF_VALUE, AFTER_VALUE, AFTER_CALL,
    CONTENT_ONLY, DROP, AFTER_LIST
) = PythonicMode  # module-level names: the hot loops compare against globals

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VALUE_STOP = re.compile(r"[\\'\"\[\]{}(),]")
_PY_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|[0-7]{1,3}|.|\n)", re.S)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b",
                   "f": "\f", "v": "\v", "\n": ""}
_OCTAL = frozenset("01234567")
_HEX = frozenset("0123456789abcdefABCDEF")


def _decode_escape(m: re.Match[str]) -> str:
    esc = m.group(1)
    head = esc[0]
    if head in _SIMPLE_ESCAPES and len(esc) == 1:
        return _SIMPLE_ESCAPES[head]
    if head in "xuU" and len(esc) > 1:
        code = int(esc[1:], 16)
        return chr(code) if code <= 0x10FFFF else m.group(0)
    if head == "N" and len(esc) > 1:
        try:
            return unicodedata.lookup(esc[2:-1])
        except KeyError:
            return m.group(0)
    if head in _OCTAL:
        return chr(int(esc, 8))
    return m.group(0)  # Python keeps unknown escapes as written


def decode_python_string_body(raw: str) -> str:
    return _PY_ESCAPE.sub(_decode_escape, raw)


def python_string_safe_end(raw: str) -> int:
    """End of the longest prefix of a Python string body that does not stop inside an escape sequence."""
    i = raw.rfind("\\")
    if i == -1:
        return len(raw)
    j = i
    while j > 0 and raw[j - 1] == "\\":
        j -= 1
    if (i - j + 1) % 2 == 0:
        return len(raw)
    tail = raw[i + 1 :]
    if not tail:
        return i
    need = {"x": 3, "u": 5, "U": 9}.get(tail[0])
    if need is not None:
        if len(tail) < need and all(c in _HEX for c in tail[1:]):
            return i
        return len(raw)
    if tail[0] == "N":
        return len(raw) if "}" in tail or (len(tail) > 1 and tail[1] != "{") else i
    if tail[0] in _OCTAL and len(tail) < 3 and all(c in _OCTAL for c in tail):
        return i  # more octal digits may follow
    return len(raw)


def _string_close(text: str, quote: str) -> int:
    """Index of the closing quote of a Python string body (escapes honoured), or -1."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == quote:
            return i
        else:
            i += 1
    return -1


class PythonicState(msgspec.Struct):
    mode: PythonicMode = START
    held: str = ""
    calls: Count = 0
    # leading whitespace and "[" until the first call's name is known
    raw: str = ""
    params: Count = 0
    keyword: str = ""
    quote: Literal["", "'", '"'] = ""
    # a non-string literal being collected, and where its scan stands
    value: str = ""
    depth: Count = 0
    in_quote: Literal["", "'", '"', "'''", '"""'] = ""
    escape: bool = False


class _JsonNames(ast.NodeTransformer):
    """``null`` / ``true`` / ``false`` written as names (a model that read its tools as JSON) become literals."""

    NAMES: ClassVar[dict[str, bool | None]] = {"null": None, "true": True, "false": False}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


class PythonicToolParser(HeldTextToolParser):
    name: ClassVar[str] = "pythonic"
    State: ClassVar[type[msgspec.Struct]] = PythonicState
    # False: calls one after another (a newline or comma between them), no "[" ... "]" around them (OLMo 3)
    BRACKETED: ClassVar[bool] = True
    JSON_NAMES: ClassVar[bool] = False  # null / true / false read as literals (OLMo 3)

    def finish(self, state: PythonicState) -> list[Piece]:
        sink = PieceSink()
        mode, held, index = state.mode, state.held, state.calls
        if mode in (START, LIST_ITEM, NAME):
            sink.content(state.raw + held)
        elif mode in (ARGS, AFTER_VALUE, KEYWORD):
            self._close_call(state, sink)
            sink.content(held)  # an unfinished keyword is the model's text
        elif mode == VALUE_START:
            self._close_call(state, sink)
            sink.content(f"{state.keyword}={held}")
        elif mode == STR_VALUE:
            # the output ended inside a string: what was written is the value
            sink.arguments(index, json_string_fragment(decode_python_string_body(held)) + '"')
            state.params += 1
            self._close_call(state, sink)
        elif mode == BUF_VALUE:
            state.value += held
            self._emit_literal(state, sink, index)
            self._close_call(state, sink)
        else:
            sink.content(held)
        state.held = ""
        state.raw = ""
        state.value = ""
        state.mode = CONTENT_ONLY
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _not_calls(self, state: PythonicState, sink: PieceSink) -> None:
        """What looked like a call list (or its next item) is not one: the text is content, and so is the rest."""
        sink.content(state.raw)
        state.mode = CONTENT_ONLY
        state.raw = ""

    def _close_call(self, state: PythonicState, sink: PieceSink) -> None:
        sink.arguments(state.calls, "{}" if state.params == 0 else "}")
        state.calls += 1

    def _break_off(self, state: PythonicState, sink: PieceSink) -> None:
        """The call cannot go on (a positional argument, a syntax error): it is closed as it stands and the
        rest of the output, from here, is content."""
        self._close_call(state, sink)
        state.mode = CONTENT_ONLY

    def _emit_literal(self, state: PythonicState, sink: PieceSink, index: int) -> None:
        """A non-string value: the literal, or (when JSON cannot carry it) its source text as a string."""
        source = state.value.strip()
        state.value = ""
        try:
            value = ast.literal_eval(self._literal_tree(source))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = source
        if not json_safe(value):
            value = source
        sink.arguments(index, self._key(state) + dumps(value))
        state.params += 1

    def _literal_tree(self, source: str) -> str | ast.AST:
        if not self.JSON_NAMES:
            return source
        return _JsonNames().visit(ast.parse(source, mode="eval")).body  # type: ignore[no-any-return]

    def _key(self, state: PythonicState) -> str:
        return ("{" if state.params == 0 else ", ") + dumps(state.keyword) + ": "

    def _run(self, state: PythonicState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        index = state.calls
        while pos < n:
            mode = state.mode
            index = state.calls
            if mode == CONTENT_ONLY or mode == DROP:
                sink.content(buf[pos:])
                return
            if mode in (START, LIST_ITEM, ARGS, AFTER_VALUE, AFTER_CALL, VALUE_START, AFTER_LIST):
                start = pos
                pos = skip_whitespace(buf, pos)
                if state.calls == 0 and mode in (START, LIST_ITEM):
                    state.raw += buf[start:pos]
                if pos >= n:
                    return
            c = buf[pos]
            if mode == AFTER_LIST:
                state.mode = CONTENT_ONLY  # the text after the list is the model's
                continue
            if mode == START:
                if not self.BRACKETED:
                    state.mode = LIST_ITEM
                    continue
                if c != "[":
                    self._not_calls(state, sink)
                    continue
                state.raw += c
                pos += 1
                state.mode = LIST_ITEM
            elif mode == LIST_ITEM:
                if _IDENT.match(c):
                    state.mode = NAME
                else:
                    self._not_calls(state, sink)
            elif mode == NAME:
                m = _IDENT.match(buf, pos)
                if m is None:  # only a forged state gets here
                    self._not_calls(state, sink)
                    continue
                if m.end() >= n:
                    if n - pos > MAX_NAME_CHARS:
                        self._not_calls(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                if buf[m.end()] != "(":
                    self._not_calls(state, sink)
                    continue
                sink.name(index, m.group(0))
                state.raw = ""
                state.params = 0
                pos = m.end() + 1
                state.mode = ARGS
            elif mode == ARGS:
                if c == ")":
                    sink.arguments(index, "{}" if state.params == 0 else "}")
                    state.calls += 1
                    pos += 1
                    state.mode = AFTER_CALL
                elif _KEYWORD.match(c):
                    state.mode = KEYWORD
                else:
                    self._break_off(state, sink)  # positional arguments have no JSON form
            elif mode == KEYWORD:
                m = _KEYWORD.match(buf, pos)
                if m is None:
                    self._break_off(state, sink)
                    continue
                after = skip_whitespace(buf, m.end())
                if after >= n:
                    if n - pos > MAX_NAME_CHARS:
                        self._break_off(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                if buf[after] != "=" or buf.startswith("==", after):
                    self._break_off(state, sink)  # a positional argument that is a name
                    continue
                state.keyword = m.group(0)
                pos = after + 1
                state.mode = VALUE_START
            elif mode == VALUE_START:
                if c in "'\"":
                    ahead = buf[pos : pos + 3]
                    if len(ahead) < 3 and ahead == c * len(ahead):
                        state.held = buf[pos:]  # "'" or "''" might open a triple-quoted string
                        return
                    if ahead == c * 3:
                        self._start_buffered(state)
                        continue
                    sink.arguments(index, self._key(state) + '"')
                    state.quote = c  # type: ignore[assignment]  # c is a quote here
                    pos += 1
                    state.mode = STR_VALUE
                else:
                    self._start_buffered(state)
            elif mode == STR_VALUE:
                close = _string_close(buf[pos:], state.quote)
                if close == -1:
                    body = buf[pos:]
                    safe = python_string_safe_end(body)
                    sink.arguments(index, json_string_fragment(decode_python_string_body(body[:safe])))
                    state.held = body[safe:]
                    return
                body = buf[pos : pos + close]
                sink.arguments(index, json_string_fragment(decode_python_string_body(body)) + '"')
                state.params += 1
                pos += close + 1
                state.mode = AFTER_VALUE
            elif mode == BUF_VALUE:
                pos = self._scan_value(state, buf, pos, n)
                if state.mode == BUF_VALUE:
                    state.held = buf[pos:]
                    return
                self._emit_literal(state, sink, index)
            elif mode == AFTER_VALUE:
                if c == ",":
                    pos += 1
                    state.mode = ARGS
                elif c == ")":
                    state.mode = ARGS
                else:
                    self._break_off(state, sink)
            else:  # AFTER_CALL
                if c == ",":
                    pos += 1
                    state.mode = LIST_ITEM
                elif not self.BRACKETED and _IDENT.match(c):
                    state.mode = NAME  # the next call
                elif c == "]" and self.BRACKETED:
                    pos += 1
                    state.mode = AFTER_LIST
                else:
                    state.mode = CONTENT_ONLY  # the list ends without its "]": the rest is the model's text

    def _start_buffered(self, state: PythonicState) -> None:
        state.mode = BUF_VALUE
        state.value = ""
        state.depth = 0
        state.in_quote = ""
        state.escape = False

    def _scan_value(self, state: PythonicState, buf: str, pos: int, n: int) -> int:
        """Collect a literal until "," or ")" at depth 0; sets mode AFTER_VALUE when it ends."""
        i = pos
        while i < n:
            if state.escape:
                state.escape = False
                i += 1
                continue
            m = _VALUE_STOP.search(buf, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = buf[i]
            if c in "'\"" and (not state.in_quote or state.in_quote[0] == c):
                run = c * 3
                if n - i < 3 and buf[i:] == c * (n - i):
                    # one or two quotes at the end may be the start of a triple quote: look again later
                    state.value += buf[pos:i]
                    return i
                if state.in_quote == run or (not state.in_quote and buf.startswith(run, i)):
                    if state.in_quote and not buf.startswith(run, i):
                        i += 1  # a lone quote inside a triple-quoted string
                        continue
                    state.in_quote = "" if state.in_quote else run  # type: ignore[assignment]  # a triple quote
                    i += 3
                    continue
                if state.in_quote == c:
                    state.in_quote = ""
                elif not state.in_quote:
                    state.in_quote = c  # type: ignore[assignment]  # c is a quote here
            elif c == "\\":
                if state.in_quote:
                    state.escape = True
            elif state.in_quote:
                pass
            elif c in "[{(":
                state.depth += 1
            elif c in "]})":
                if state.depth == 0:
                    state.value += buf[pos:i]
                    state.mode = AFTER_VALUE
                    return i
                state.depth -= 1
            elif c == "," and state.depth == 0:
                state.value += buf[pos:i]
                state.mode = AFTER_VALUE
                return i
            i += 1
        state.value += buf[pos:n]
        return n
