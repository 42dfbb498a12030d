"""seed_oss: Seed-OSS calls (Qwen3-Coder's markup inside ``<seed:tool_call>``).

    <seed:tool_call>
    <function=NAME>
    <parameter=K>V</parameter>
    </function>
    </seed:tool_call>

Values lose one leading and one trailing newline (upstream's rule); a parameter the schema does not declare
stays a string. A ``<seed:think>`` block left in the content (no reasoning parser) is content: a call the model
quotes while thinking is not a call.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from render_service.parsers.tools_qwen3_xml import QWEN3_XML_FORMAT
from render_service.parsers.tools_xml import XmlFormat, XmlToolParser

SEED_OSS_FORMAT = msgspec.structs.replace(
    QWEN3_XML_FORMAT, block_open="<seed:tool_call>", block_end="</seed:tool_call>", bare_call_open=False,
    opaque=("<seed:think>", "</seed:think>"))


class SeedOssToolParser(XmlToolParser):
    name: ClassVar[str] = "seed_oss"
    FORMAT: ClassVar[XmlFormat] = SEED_OSS_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<seed:tool_call>\n"
    FORCED_NAMED: ClassVar[str] = "<seed:tool_call>\n<function={name}>\n"
