"""qwen3_xml: Qwen3-Coder / Qwen3.5 XML calls, on the shared XML engine (``tools_xml``).

    <tool_call>
    <function=NAME>
    <parameter=K>
    V
    </parameter>
    </function>
    </tool_call>

The markup of ``qwen3_coder``; what this name adds is upstream qwen3_xml's robustness: text after the calls is
content, a literal ``</parameter>`` inside a value stays in the value unless structure follows, a cut-off call
is closed, and values are typed by the whole schema (``anyOf``, type lists, nullable). A bare ``<function=``
outside ``<tool_call>`` also starts a call.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from render_service.parsers.tools_xml import XmlFormat, XmlToolParser

QWEN3_XML_FORMAT = XmlFormat(
    block_open="<tool_call>",
    block_end="</tool_call>",
    call_open="<function=",
    head_ends=(">",),
    head_consumed=(">",),
    call_end="</function>",
    key_open="<parameter=",
    key_end=">",
    value_open=None,
    value_end="</parameter>",
    trim="newline",
    bare_call_open=True,
)


class Qwen3XmlToolParser(XmlToolParser):
    name: ClassVar[str] = "qwen3_xml"
    FORMAT: ClassVar[XmlFormat] = QWEN3_XML_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<tool_call>\n"
    FORCED_NAMED: ClassVar[str] = "<tool_call>\n<function={name}>\n"


class Step5ToolParser(Qwen3XmlToolParser):
    """step5 (Step-5): Qwen3's XML calls; upstream keeps the content's whitespace around calls, as we always do."""

    name: ClassVar[str] = "step5"


MIMO_FORMAT = msgspec.structs.replace(QWEN3_XML_FORMAT, trim="none")


class MiMoToolParser(Qwen3XmlToolParser):
    """mimo (Xiaomi MiMo): Qwen3's XML calls written compactly (``<parameter=K>V</parameter>``); values keep
    every character (no newline trimming, as upstream's converter) and are typed by the schema afterwards."""

    name: ClassVar[str] = "mimo"
    FORMAT: ClassVar[XmlFormat] = MIMO_FORMAT


class Step3p5ToolParser(Qwen3XmlToolParser):
    name: ClassVar[str] = "step3p5"  # Step-3.5 / 3.7 write Qwen3's XML calls


class GraniteToolCallToolParser(Qwen3XmlToolParser):
    name: ClassVar[str] = "granite_toolcall_parser"  # Granite 4.2 writes Qwen3's (Nemotron 3's) XML calls


ZAYA_XML_FORMAT = msgspec.structs.replace(QWEN3_XML_FORMAT, block_open="<zyphra_tool_call>",
                                          block_end="</zyphra_tool_call>")


class ZayaXmlToolParser(Qwen3XmlToolParser):
    """zaya_xml (Zyphra ZAYA1): Qwen3's XML calls in ``<zyphra_tool_call>`` (upstream's parser is a copy of
    qwen3_xml's with these tags); a bare ``<function=`` also starts a call."""

    name: ClassVar[str] = "zaya_xml"
    FORMAT: ClassVar[XmlFormat] = ZAYA_XML_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<zyphra_tool_call>\n"
    FORCED_NAMED: ClassVar[str] = "<zyphra_tool_call>\n<function={name}>\n"


class ZayaToolParser(ZayaXmlToolParser):
    name: ClassVar[str] = "zaya"  # upstream registers zaya_xml as this name's alias
