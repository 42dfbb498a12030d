"""qwen3_coder / qwen3_xml: XML-style calls (Qwen3-Coder, Qwen3.5+).

    <tool_call>
    <function=NAME>
    <parameter=P>
    value, may span lines
    </parameter>
    </function>
    </tool_call>

Arguments are built as ``json.dumps(dict, ensure_ascii=False)`` of the converted parameters, streamed in
order: ``{`` with the name, each ``"key": value`` as it completes, ``}`` at ``</function>``. Values lose one
leading and one trailing newline and are converted by the declared JSON-schema type (parser-semantics §2.3).
String values (and values of undeclared parameters) stream as they arrive, escaped per character; typed
values (numbers, booleans, objects, ...) are short and are held until ``</parameter>`` to be converted.
"""

from __future__ import annotations

import ast
import json
from enum import IntEnum
from typing import Any, ClassVar

import msgspec

from render_service.parsers.base import Piece, ToolParserConfig
from render_service.parsers.json_scan import dumps, json_string_fragment
from render_service.parsers.tags import find_tag, is_partial_tag, skip_whitespace
from render_service.parsers.tools_common import (
    MAX_NAME_CHARS,
    Count,
    HeldTextToolParser,
    PieceSink,
    tools_by_name,
)

TOOL_CALL = "<tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
TOOL_CALL_END = "</tool_call>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

class Qwen3CoderMode(IntEnum):
    """Where a qwen3_coder XML stream is. Travels in stream_state as its int."""

    CONTENT = 0
    CALL_OPEN = 1
    FUNC_NAME = 2
    IN_FUNC = 3
    PARAM_NAME = 4
    PARAM_VALUE = 5


(
    CONTENT, CALL_OPEN, FUNC_NAME, IN_FUNC, PARAM_NAME, PARAM_VALUE
) = Qwen3CoderMode  # module-level names: the hot loops compare against globals

STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
NUMBER_PREFIXES = ("num", "float", "double")
BOOL_TYPES = frozenset({"boolean", "bool", "binary"})
STRUCTURED_PREFIXES = ("object", "array", "dict", "list", "tuple", "arr")


class Qwen3CoderState(msgspec.Struct):
    mode: Qwen3CoderMode = CONTENT
    held: str = ""
    calls: Count = 0
    # text since the opening tag, kept only until the function name is known (see hermes)
    raw: str = ""
    function: str = ""
    params: Count = 0
    param: str = ""
    # the current value streams as a JSON string (True) or is held whole for conversion (False)
    streaming_value: bool = True
    value: str = ""
    value_started: bool = False


def _schema_type(parameters: dict[str, Any] | None, param: str) -> tuple[str | None, bool]:
    """(declared type, nullable) of ``param``; (None, False) when the schema does not declare it."""
    if not isinstance(parameters, dict):
        return None, False
    props = parameters.get("properties")
    if not isinstance(props, dict) or not isinstance(props.get(param), dict):
        return None, False
    prop = props[param]
    declared = prop.get("type", "string")
    nullable = bool(prop.get("nullable", False))
    if isinstance(declared, list):
        nullable = nullable or "null" in declared
        declared = next((t for t in declared if t != "null"), "string")
    if not isinstance(declared, str):
        return "string", nullable
    return declared.strip().lower(), nullable


def convert_value(value: str, declared: str | None, nullable: bool) -> Any:
    """A parameter's text converted by its declared type; the raw text whenever conversion fails."""
    if declared is None:
        return value
    is_string = declared in STRING_TYPES
    if (not is_string or nullable) and value.strip().lower() in ("null", "none"):
        return None
    if is_string:
        return value
    text = value.strip()
    if declared.startswith(INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return value
    if declared.startswith(NUMBER_PREFIXES):
        try:
            number = float(text)
        except ValueError:
            return value
        if number.is_integer() and abs(number) < 2**63:
            return int(number)
        return number if number == number and abs(number) != float("inf") else value
    if declared in BOOL_TYPES:
        return text.lower() == "true"
    if declared.startswith(STRUCTURED_PREFIXES):
        try:
            return json.loads(text)
        except ValueError:
            pass
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value
    return value


class Qwen3CoderToolParser(HeldTextToolParser):
    name: ClassVar[str] = "qwen3_coder"
    State: ClassVar[type[msgspec.Struct]] = Qwen3CoderState

    def __init__(self, config: ToolParserConfig) -> None:
        self.tools = tools_by_name(config.tools if config is not None else [])

    def finish(self, state: Qwen3CoderState) -> list[Piece]:
        sink = PieceSink()
        if state.mode == CONTENT:
            if state.calls == 0:
                sink.content(state.held)
        elif state.mode in (CALL_OPEN, FUNC_NAME):
            self._release(state, sink, state.held)
        # Inside a function the arguments stay as streamed: a truncated call is never completed for the model.
        state.held = ""
        state.mode = CONTENT
        state.raw = ""
        state.value = ""
        return sink.pieces

    # -----------------------------------------------------------------------------------------------------

    def _release(self, state: Qwen3CoderState, sink: PieceSink, extra: str = "") -> None:
        if state.calls == 0:
            sink.content(state.raw + extra)
        state.raw = ""
        state.mode = CONTENT

    def _param_type(self, state: Qwen3CoderState) -> tuple[str | None, bool]:
        tool = self.tools.get(state.function)
        return _schema_type(tool.parameters if tool else None, state.param)

    def _key(self, state: Qwen3CoderState) -> str:
        return (", " if state.params else "") + dumps(state.param) + ": "

    def _run(self, state: Qwen3CoderState, buf: str, sink: PieceSink) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            mode = state.mode
            if mode == CONTENT:
                at, tag = find_tag(buf, pos, (TOOL_CALL, FUNCTION))
                if state.calls == 0:
                    sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.raw = tag
                state.mode = CALL_OPEN if tag == TOOL_CALL else FUNC_NAME
            elif mode == CALL_OPEN:
                start = pos
                pos = skip_whitespace(buf, pos)
                state.raw += buf[start:pos]
                if pos >= n:
                    return
                if buf.startswith(FUNCTION, pos):
                    state.raw += FUNCTION
                    pos += len(FUNCTION)
                    state.mode = FUNC_NAME
                elif buf.startswith(TOOL_CALL, pos):
                    state.raw += TOOL_CALL
                    pos += len(TOOL_CALL)
                elif is_partial_tag(buf[pos:], (FUNCTION, TOOL_CALL)):
                    state.held = buf[pos:]
                    return
                else:
                    self._release(state, sink)
            elif mode == FUNC_NAME:
                gt = buf.find(">", pos, pos + MAX_NAME_CHARS + 1)
                if gt == -1:
                    if n - pos > MAX_NAME_CHARS:
                        self._release(state, sink)
                        continue
                    state.held = buf[pos:]
                    return
                name = buf[pos:gt].strip()
                if not name or any(c in name for c in "<\n"):
                    self._release(state, sink)
                    continue
                pos = gt + 1
                state.raw = ""
                state.function = name
                state.params = 0
                state.mode = IN_FUNC
                sink.name(state.calls, name)
                sink.arguments(state.calls, "{")
            elif mode == IN_FUNC:
                lt = buf.find("<", pos)
                if lt == -1:
                    return  # whitespace (or stray text) between parameters is not part of anything
                pos = lt
                if buf.startswith(PARAMETER, pos):
                    pos += len(PARAMETER)
                    state.mode = PARAM_NAME
                elif any(buf.startswith(t, pos) for t in (FUNCTION_END, TOOL_CALL_END, TOOL_CALL, FUNCTION)):
                    # a missing </function> is implied by </tool_call> or by the next call's opening tag
                    if buf.startswith(FUNCTION_END, pos):
                        pos += len(FUNCTION_END)
                    sink.arguments(state.calls, "}")
                    state.calls += 1
                    state.mode = CONTENT
                elif is_partial_tag(buf[pos:], (PARAMETER, FUNCTION_END, TOOL_CALL_END, TOOL_CALL, FUNCTION)):
                    state.held = buf[pos:]
                    return
                else:
                    pos += 1
            elif mode == PARAM_NAME:
                gt = buf.find(">", pos, pos + MAX_NAME_CHARS + 1)
                if gt == -1:
                    if n - pos > MAX_NAME_CHARS:
                        pos = n  # not a parameter tag after all; skip it
                        state.mode = IN_FUNC
                        continue
                    state.held = buf[pos:]
                    return
                state.param = buf[pos:gt].strip()
                pos = gt + 1
                declared, nullable = self._param_type(state)
                state.streaming_value = declared is None or (declared in STRING_TYPES and not nullable)
                state.value = ""
                state.value_started = False
                state.mode = PARAM_VALUE
                if state.streaming_value:
                    sink.arguments(state.calls, self._key(state) + '"')
            else:  # PARAM_VALUE
                if not state.value_started:
                    state.value_started = True
                    if buf[pos] == "\n":  # exactly one leading newline is layout, not value
                        pos += 1
                        continue
                at, tag = find_tag(buf, pos, (PARAMETER_END,))
                if tag is not None:
                    chunk = buf[pos:at]
                    if chunk.endswith("\n"):  # and exactly one trailing newline
                        chunk = chunk[:-1]
                    self._value_text(state, sink, chunk)
                    self._end_value(state, sink)
                    pos = at + len(PARAMETER_END)
                    state.mode = IN_FUNC
                else:
                    safe = at
                    if safe > pos and buf[safe - 1] == "\n":
                        safe -= 1  # might be the trailing newline before </parameter>
                    self._value_text(state, sink, buf[pos:safe])
                    state.held = buf[safe:]
                    return

    def _value_text(self, state: Qwen3CoderState, sink: PieceSink, text: str) -> None:
        if state.streaming_value:
            sink.arguments(state.calls, json_string_fragment(text))
        else:
            state.value += text

    def _end_value(self, state: Qwen3CoderState, sink: PieceSink) -> None:
        if state.streaming_value:
            sink.arguments(state.calls, '"')
        else:
            declared, nullable = self._param_type(state)
            value = convert_value(state.value, declared, nullable)
            sink.arguments(state.calls, self._key(state) + dumps(value))
            state.value = ""
        state.params += 1
