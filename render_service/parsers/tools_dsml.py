"""deepseek_v32 / deepseek_v4: DeepSeek's DSML calls (the bars are fullwidth, U+FF5C).

    <｜DSML｜tool_calls>                                  (V3.2: <｜DSML｜function_calls>)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="N" string="false">5</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A parameter the tool's schema declares is typed by the schema (as vLLM 0.33's parser, which coerces every value
to the schema after reading it); for one it does not declare, the model's ``string`` attribute decides:
``"true"`` is raw text, ``"false"`` (or no attribute) a JSON literal, else its text. Values keep every character
(upstream does not strip them). Everything else is the XML engine's (``tools_xml``): both invariants, text around calls
is content, a cut-off call is closed.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from render_service.parsers.tools_xml import XmlFormat, XmlToolParser

DSML = "\uff5cDSML\uff5c"

DSML_V4_FORMAT = XmlFormat(
    block_open=f"<{DSML}tool_calls>",
    block_end=f"</{DSML}tool_calls>",
    call_open=f"<{DSML}invoke name=",
    head_ends=(">",),
    head_consumed=(">",),
    call_end=f"</{DSML}invoke>",
    key_open=f"<{DSML}parameter name=",
    key_end=">",
    value_open=None,
    value_end=f"</{DSML}parameter>",
    trim="none",
    undeclared="string",
    quoted_names=True,
    string_attr=True,
)

DSML_V32_FORMAT = msgspec.structs.replace(
    DSML_V4_FORMAT, block_open=f"<{DSML}function_calls>", block_end=f"</{DSML}function_calls>")


class DeepSeekV4ToolParser(XmlToolParser):
    name: ClassVar[str] = "deepseek_v4"
    FORMAT: ClassVar[XmlFormat] = DSML_V4_FORMAT
    FORCED_REQUIRED: ClassVar[str] = f"<{DSML}tool_calls>\n"
    FORCED_NAMED: ClassVar[str] = f"<{DSML}tool_calls>\n<{DSML}invoke name=\"{{name}}\">\n"


class DeepSeekV32ToolParser(XmlToolParser):
    name: ClassVar[str] = "deepseek_v32"
    FORMAT: ClassVar[XmlFormat] = DSML_V32_FORMAT
    FORCED_REQUIRED: ClassVar[str] = f"<{DSML}function_calls>\n"
    FORCED_NAMED: ClassVar[str] = f"<{DSML}function_calls>\n<{DSML}invoke name=\"{{name}}\">\n"


# DeepSeek-V4.1: the same markup with a space after the DSML marker and the block named "calls"
DSML_V41 = f"{DSML} "
DSML_V41_FORMAT = msgspec.structs.replace(
    DSML_V4_FORMAT, block_open=f"<{DSML_V41}calls>", block_end=f"</{DSML_V41}calls>",
    call_open=f"<{DSML_V41}invoke name=", call_end=f"</{DSML_V41}invoke>", key_open=f"<{DSML_V41}parameter name=",
    value_end=f"</{DSML_V41}parameter>")


class DeepSeekV41ToolParser(XmlToolParser):
    name: ClassVar[str] = "deepseek_v41"
    FORMAT: ClassVar[XmlFormat] = DSML_V41_FORMAT
    FORCED_REQUIRED: ClassVar[str] = f"<{DSML_V41}calls>\n"
    FORCED_NAMED: ClassVar[str] = f"<{DSML_V41}calls>\n<{DSML_V41}invoke name=\"{{name}}\">\n"
