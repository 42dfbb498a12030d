"""deepseek_v31 (DeepSeek V3.1 / V3.2-exp):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Content is the text before the first marker; arguments are the model's raw text, multi-line included (vLLM's
batch regex misses those: parser-semantics V-T30; we return the call).
"""

from __future__ import annotations

from typing import Any, ClassVar

from render_service.parsers.tools_sectioned import SectionedToolParser
from render_service.parsers.tools_wrapped import DroppedMarkersToolParser


class DeepSeekV31ToolParser(SectionedToolParser):
    name: ClassVar[str] = "deepseek_v31"
    SECTION_BEGIN = ("<｜tool▁calls▁begin｜>",)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    NAME_END = "<｜tool▁sep｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SECTION_END = ("<｜tool▁calls▁end｜>",)


class DeepSeekV3ToolParser(SectionedToolParser):
    """deepseek_v3 (DeepSeek-V3 / R1-0528): the call's type before the separator, the name after it, the
    arguments in a ```json fence:

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json
        {ARGS}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    """

    name: ClassVar[str] = "deepseek_v3"
    SECTION_BEGIN = ("<｜tool▁calls▁begin｜>",)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    NAME_END = "```json"
    CALL_END = "<｜tool▁call▁end｜>"
    SECTION_END = ("<｜tool▁calls▁end｜>",)
    ARGS_FENCE = "```"
    SEPARATOR = "<｜tool▁sep｜>"

    def read_name(self, text: str, index: int) -> tuple[str, str | None] | None:
        kind, sep, name = text.partition(self.SEPARATOR)
        if not sep or kind.strip() != "function":
            return None
        return super().read_name(name, index)


class Plamo3CallsParser(SectionedToolParser):
    name: ClassVar[str] = "plamo3_calls"
    SECTION_BEGIN = ("<|plamo:begin_tool_requests:plamo|>",)
    CALL_BEGIN = "<|plamo:begin_tool_name:plamo|>"
    NAME_END = "<|plamo:end_tool_name:plamo|>"
    CALL_END = "<|plamo:end_tool_arguments:plamo|>"
    SECTION_END = ("<|plamo:end_tool_requests:plamo|>",)


class Plamo3ToolParser(DroppedMarkersToolParser):
    """plamo3 (PLaMo 3): a tool-request block of requests, each a name and JSON arguments between control
    markers. The per-request framing and the arguments' constrain header are dropped (markup); the rest is the
    sectioned engine's (names, guarded arguments, text around calls is content)."""

    name: ClassVar[str] = "plamo3"
    DROPPED: ClassVar[tuple[str, ...]] = (
        "<|plamo:begin_tool_request:plamo|>", "<|plamo:end_tool_request:plamo|>",
        "<|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>",
    )
    INNER: ClassVar[Any] = Plamo3CallsParser
