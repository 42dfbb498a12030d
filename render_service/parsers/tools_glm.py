"""glm45 / glm47: GLM-4.5, 4.6 and 4.7 calls.

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    </tool_call>

GLM-4.7 writes the same without newlines (``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>``) and
sometimes a literal ``\\n`` between a key and its value; one parser reads both spellings, so both names map to it.
Values keep every character when the schema says string (upstream does not strip them); any other value is
read stripped, and a parameter the schema does not declare is a JSON/Python literal when it parses (upstream's
``_deserialize``), else its text.
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_xml import XmlFormat, XmlToolParser

GLM_FORMAT = XmlFormat(
    block_open="<tool_call>",
    block_end="</tool_call>",
    call_open=None,
    head_ends=("\n", "<arg_key>", "</tool_call>"),
    head_consumed=("\n",),
    call_end="</tool_call>",
    key_open="<arg_key>",
    key_end="</arg_key>",
    value_open="<arg_value>",
    value_end="</arg_value>",
    trim="none",
    undeclared="json",
    skip_escaped_newlines=True,
)


class Glm45ToolParser(XmlToolParser):
    name: ClassVar[str] = "glm45"
    FORMAT: ClassVar[XmlFormat] = GLM_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<tool_call>"
    FORCED_NAMED: ClassVar[str] = "<tool_call>{name}\n"


class Glm47ToolParser(Glm45ToolParser):
    name: ClassVar[str] = "glm47"
    FORCED_NAMED: ClassVar[str] = "<tool_call>{name}"  # GLM-4.7's template writes no newline after the name


class Ling3ToolParser(Glm47ToolParser):
    name: ClassVar[str] = "ling3"  # Ling 3 writes GLM-4.7's calls (upstream configures GLM-4.7's engine)
