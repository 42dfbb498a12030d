"""kimi_k2 (Kimi K2 / K2.5):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}
    <|tool_call_end|>...<|tool_calls_section_end|>

The model names each call ``functions.NAME:IDX``: that is the call's id (ToolCallPiece.id) and NAME its name
(``NAME:IDX`` without the prefix is accepted too). Anything else in that place (a bare counter ``0``, a
malformed ``functions.x.0``) names the call only when the request's tools make it unambiguous: the one tool
whose name appears in it, or the only tool when it names none. The id stays the model's text, so nothing it wrote
is lost and the next turn renders the call as generated; an empty one becomes ``functions.NAME:INDEX``, the
model's own style. A bare id that names no tool with several tools on offer is named by its arguments once
the call ends: the one tool whose declared parameters hold every argument key and whose required ones are all
there. Otherwise the call is not one and its text is content.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from render_service.parsers.tools_sectioned import SectionedToolParser

_CALL_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_\-.]+):([0-9]+)")
_WORD = re.compile(r"[A-Za-z0-9_\-]+")


class KimiK2ToolParser(SectionedToolParser):
    name: ClassVar[str] = "kimi_k2"
    # some Kimi checkpoints spell the section marker in the singular
    SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    CALL_BEGIN = "<|tool_call_begin|>"
    NAME_END = "<|tool_call_argument_begin|>"
    CALL_END = "<|tool_call_end|>"
    SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")

    def read_name(self, text: str, index: int) -> tuple[str, str | None] | None:
        call_id = text.strip()
        m = _CALL_ID.fullmatch(call_id)
        if m is not None:
            return m.group(1), call_id
        declared = [t.name for t in self.config.tools]
        words = {w for w in _WORD.findall(call_id) if w != "functions" and not w.isdigit()}
        named = [name for name in declared if name in words]
        if len(named) == 1:
            name = named[0]
        elif not words and len(declared) == 1:
            name = declared[0]  # a bare counter: the request has one tool
        else:
            return None
        return name, call_id or f"functions.{name}:{index}"

    def defers_name(self, text: str) -> bool:
        words = {w for w in _WORD.findall(text) if w != "functions" and not w.isdigit()}
        return not words and len(self.config.tools) > 1

    def name_from_arguments(self, text: str, arguments: str, index: int) -> tuple[str, str | None] | None:
        try:
            args = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        keys = set(args)
        fits = []
        for tool in self.config.tools:
            params = tool.parameters if isinstance(tool.parameters, dict) else {}
            props = params.get("properties")
            declared = set(props) if isinstance(props, dict) else set()
            required = params.get("required")
            needed = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            if keys <= declared and needed <= keys:
                fits.append(tool.name)
        if len(fits) != 1:
            return None
        return fits[0], text.strip() or f"functions.{fits[0]}:{index}"
