"""minimax_m2: MiniMax-M2 calls, several ``<invoke>`` per block.

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="K">V</parameter>
    </invoke>
    </minimax:tool_call>

Names and keys may be quoted with ``"`` or ``'`` (or not at all); values lose their leading and trailing
whitespace (upstream strips them; we drop at most 64 trailing whitespace characters, so what streaming
holds back stays bounded); a parameter the schema does not declare stays a string.
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_xml import XmlFormat, XmlToolParser

MINIMAX_M2_FORMAT = XmlFormat(
    block_open="<minimax:tool_call>",
    block_end="</minimax:tool_call>",
    call_open="<invoke name=",
    head_ends=(">",),
    head_consumed=(">",),
    call_end="</invoke>",
    key_open="<parameter name=",
    key_end=">",
    value_open=None,
    value_end="</parameter>",
    trim="strip",
    quoted_names=True,
)


class MiniMaxM2ToolParser(XmlToolParser):
    name: ClassVar[str] = "minimax_m2"
    FORMAT: ClassVar[XmlFormat] = MINIMAX_M2_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<minimax:tool_call>\n"
    FORCED_NAMED: ClassVar[str] = "<minimax:tool_call>\n<invoke name=\"{name}\">\n"
