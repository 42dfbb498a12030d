"""deepseek_v31 (DeepSeek V3.1 / V3.2-exp):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Content is the text before the first marker; arguments are the model's raw text, multi-line included (vLLM's
batch regex misses those: parser-semantics V-T30; we return the call).
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_sectioned import SectionedToolParser


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
