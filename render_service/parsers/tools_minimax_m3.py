"""minimax_m3 (MiniMax-M3): namespaced XML calls whose arguments are elements named by their key.

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="create_order">]<]minimax[>[<user_id>42]<]minimax[>[</user_id>
    ]<]minimax[>[<shipping>]<]minimax[>[<city>Singapore]<]minimax[>[</city>]<]minimax[>[</shipping>
    ]<]minimax[>[<items>]<]minimax[>[<item>..]<]minimax[>[</item>]<]minimax[>[</items>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Every tag carries the ``]<]minimax[>[`` namespace marker. An element holding elements is an object (a key
written twice collects its values in a list), one holding only ``<item>`` elements is a list, one holding text is a
value typed by the tool's schema at its path (``tool_schema``; text where the schema says nothing). Whether an
element is an object or a value is known only once its children are, and a repeated key turns a value into a list,
so each call is read whole: its arguments are sent when its ``</invoke>`` arrives (as upstream's parser does),
at most ``MAX_INVOKE`` characters of it held. Text outside the calls, and text inside a block between calls, is
content; an invoke longer than the bound is given back as content.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import Any, ClassVar

import msgspec

from render_service.parsers import tool_schema
from render_service.parsers.base import Piece, ToolParserConfig
from render_service.parsers.json_scan import dumps
from render_service.parsers.tags import find_tag
from render_service.parsers.tools_common import Count, HeldTextToolParser, PieceSink, require, tools_by_name

NS = "]<]minimax[>["
BLOCK_OPEN = NS + "<tool_call>"
BLOCK_END = NS + "</tool_call>"
INVOKE_OPEN = NS + "<invoke"
INVOKE_END = NS + "</invoke>"
MAX_INVOKE = 60_000  # characters of one call held until its end (stream_state stays under its 64 KiB cap)

_TAG = re.compile(re.escape(NS) + r"<(/?)([A-Za-z_][\w.\-]*)>")
_INVOKE_NAME = re.compile(r"""\s+name\s*=\s*(["'])(.*?)\1\s*>""", re.S)


class M3Mode(IntEnum):
    CONTENT = 0
    BLOCK = 1  # inside a tool_call block, between calls
    INVOKE = 2  # inside a call, held until its end


CONTENT, BLOCK, INVOKE = M3Mode


class M3State(msgspec.Struct, omit_defaults=True):
    mode: M3Mode = CONTENT
    held: str = ""
    calls: Count = 0
    layout: bool = False  # whitespace right after a block opener or a call is layout

    def __post_init__(self) -> None:
        require(len(self.held) <= MAX_INVOKE + len(INVOKE_END), "held text within bounds")


def _element_value(node: dict[str, Any], schema: Any, stray: list[str]) -> Any:
    """An element: its children as an object or list, else its text typed by ``schema``. Text beside child
    elements is not part of the value: it goes to ``stray`` (the model's text, given back as content)."""
    children: list[tuple[str, dict[str, Any]]] = node["children"]
    if not children:
        return tool_schema.convert("".join(node["text"]).strip(), tool_schema.schema_types(schema) or None)
    stray.extend(t for t in node["text"] if t.strip())
    sub = schema if isinstance(schema, dict) else {}
    if all(name == "item" for name, _ in children) and not isinstance(sub.get("properties"), dict):
        return [_element_value(child, sub.get("items"), stray) for _, child in children]
    props: dict[str, Any] = sub["properties"] if isinstance(sub.get("properties"), dict) else {}
    extra = sub.get("additionalProperties")
    values: dict[str, list[Any]] = {}
    for name, child in children:
        child_schema = props.get(name, extra if isinstance(extra, dict) else None)
        values.setdefault(name, []).append(_element_value(child, child_schema, stray))
    # a key written twice collects its values in a list
    return {name: vals[0] if len(vals) == 1 else vals for name, vals in values.items()}


def read_arguments(body: str, parameters: Any, stray: list[str]) -> dict[str, Any]:
    """The arguments of one call from the elements in ``body`` (tags left open at a cut are closed); text that
    is no element's value goes to ``stray``."""
    root: dict[str, Any] = {"children": [], "text": []}
    stack: list[tuple[str, dict[str, Any]]] = [("", root)]
    pos = 0
    for m in _TAG.finditer(body):
        stack[-1][1]["text"].append(body[pos:m.start()])
        pos = m.end()
        closing, name = m.group(1), m.group(2)
        if not closing:
            node: dict[str, Any] = {"children": [], "text": []}
            stack[-1][1]["children"].append((name, node))
            stack.append((name, node))
        elif any(n == name for n, _ in stack[1:]):
            while stack[-1][0] != name:
                stack.pop()
            stack.pop()
    stack[-1][1]["text"].append(body[pos:])
    schema = parameters if isinstance(parameters, dict) else {"type": "object"}
    if not root["children"]:
        stray.extend(t for t in root["text"] if t.strip())
        return {}
    value = _element_value(root, schema, stray)
    return value if isinstance(value, dict) else {}


class MiniMaxM3ToolParser(HeldTextToolParser):
    name: ClassVar[str] = "minimax_m3"
    State: ClassVar[type[msgspec.Struct]] = M3State

    def __init__(self, config: ToolParserConfig) -> None:
        super().__init__(config)
        self._tools = tools_by_name(config.tools)

    def _emit(self, state: M3State, invoke: str, sink: PieceSink) -> None:
        """``invoke``: the text after ``<invoke`` up to (not including) its end tag."""
        m = _INVOKE_NAME.match(invoke)
        if m is None or not m.group(2).strip():
            sink.content(INVOKE_OPEN + invoke)  # not a call the format can name
            return
        name = m.group(2).strip()
        spec = self._tools.get(name)
        stray: list[str] = []
        args = read_arguments(invoke[m.end():], spec.parameters if spec is not None else None, stray)
        sink.name(state.calls, name)
        sink.arguments(state.calls, dumps(args))
        state.calls += 1
        sink.content("".join(stray))

    def feed(self, state: M3State, text: str) -> list[Piece]:
        sink = PieceSink()
        held, state.held = state.held, ""
        # a held call was searched for its end tag already: look again only where the end tag can now be
        seen = max(0, len(held) - len(INVOKE_END) + 1) if state.mode == INVOKE else 0
        self._walk(state, held + text, sink, seen)
        return sink.pieces

    def _run(self, state: M3State, buf: str, sink: PieceSink) -> None:
        self._walk(state, buf, sink, 0)

    def _walk(self, state: M3State, buf: str, sink: PieceSink, seen: int) -> None:
        pos, n = 0, len(buf)
        while pos < n:
            if state.mode == CONTENT:
                at, tag = find_tag(buf, pos, (BLOCK_OPEN,))
                sink.content(buf[pos:at])
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.mode = BLOCK
                state.layout = True
            elif state.mode == BLOCK:
                at, tag = find_tag(buf, pos, (INVOKE_OPEN, BLOCK_END))
                text = buf[pos:at]
                if state.layout:
                    text = text.lstrip()
                    state.layout = not text
                sink.content(text)
                if tag is None:
                    state.held = buf[at:]
                    return
                pos = at + len(tag)
                state.mode = INVOKE if tag == INVOKE_OPEN else CONTENT
            else:
                end = buf.find(INVOKE_END, max(pos, seen))
                seen = 0
                if end == -1:
                    if n - pos > MAX_INVOKE:
                        sink.content(INVOKE_OPEN + buf[pos:])  # too long to hold: the model's text
                        state.mode = BLOCK
                        return
                    state.held = buf[pos:]
                    return
                self._emit(state, buf[pos:end], sink)
                pos = end + len(INVOKE_END)
                state.mode = BLOCK
                state.layout = True

    def finish(self, state: M3State) -> list[Piece]:
        sink = PieceSink()
        held, state.held = state.held, ""
        if state.mode == INVOKE:
            self._emit(state, held, sink)  # cut by the end of output: what arrived
        elif state.mode == BLOCK:
            sink.content(held.lstrip() if state.layout else held)
        elif state.mode == CONTENT:
            sink.content(held)
        state.mode = CONTENT
        state.layout = False
        return sink.pieces
