"""kimi_k2 (Kimi K2 / K2.5):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}
    <|tool_call_end|>...<|tool_calls_section_end|>

The model names each call ``functions.NAME:IDX``: that is the call's id (ToolCallPiece.id), and the name is
the part before ``:`` after the last ``.``. Arguments are the raw text, trimmed of surrounding whitespace.
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_sectioned import SectionedToolParser


class KimiK2ToolParser(SectionedToolParser):
    name: ClassVar[str] = "kimi_k2"
    # some Kimi checkpoints spell the section marker in the singular
    SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    CALL_BEGIN = "<|tool_call_begin|>"
    NAME_END = "<|tool_call_argument_begin|>"
    CALL_END = "<|tool_call_end|>"
    SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    TRIM_ARGUMENTS = True

    def read_name(self, text: str) -> tuple[str, str | None]:
        call_id = text.strip()
        name = call_id.split(":", 1)[0].rsplit(".", 1)[-1].strip()
        return name, call_id or None
