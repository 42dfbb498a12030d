"""qwen3_coder: Qwen3-Coder / Qwen3.5+ XML calls, on the shared XML engine (``tools_xml``).

    <tool_call>
    <function=NAME>
    <parameter=P>
    value, may span lines
    </parameter>
    </function>
    </tool_call>

The same markup and the same rules as ``qwen3_xml`` (upstream serves both names from one engine now): values
typed by the tool's whole JSON schema (``tool_schema``: ``anyOf``/``oneOf``, type lists, nullable, arrays and
objects, a JSON string holding an object), a literal ``</parameter>`` inside a value stays in the value unless
structure follows, a value missing its ``</parameter>`` is closed by ``</function>``, text after the calls is
content, and a call cut off by ``max_tokens`` is closed. See docs/tool_parsers.md.

The one difference from ``qwen3_xml``: ``tool_choice`` "required" / named keep the JSON-grammar path (vLLM's
rule for this parser name), so render does not open the call in the prompt.
"""

from __future__ import annotations

from typing import ClassVar

from render_service.parsers.tools_qwen3_xml import Qwen3XmlToolParser


class Qwen3CoderToolParser(Qwen3XmlToolParser):
    name: ClassVar[str] = "qwen3_coder"
    native_forced_choice: ClassVar[bool] = False
