"""More families on the shared XML engine (``tools_xml``): each is its tags, declared.

* ``poolside_v1``: GLM-4.5's markup exactly (``<tool_call>NAME`` ``<arg_key>K</arg_key><arg_value>V</arg_value>``
  ``</tool_call>``); values typed by the schema, undeclared ones read as JSON/Python literals, as upstream.
* ``dots``: MiniMax-M2's ``<invoke name=...>`` / ``<parameter name=...>`` inside ``<dots_function_call>``.
* ``hy_v3``: ``<tool_calls><tool_call>NAME<tool_sep><arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``.
* ``hy_v4``: hy_v3's markup without ``<tool_sep>`` (the name ends at its newline or the first ``<arg_key>``);
  undeclared values stay strings (upstream's fallback type is string).
* ``k2_horizon``: K2 Horizon's IFM XML, ``<ifm|tool_calls><ifm|tool_call>NAME<ifm|arg_key>K</ifm|arg_key>``
  ``<ifm|arg_value>V</ifm|arg_value></ifm|tool_call></ifm|tool_calls>`` (the template's default
  ``tool_call_format``, "xml"); values typed by the schema, undeclared ones strings.
* ``minicpm5`` (MiniCPM5): ``<function name="NAME"><param name="K">V</param></function>``, each call bare (no
  block around it); values stripped, typed by the schema, undeclared ones read as JSON/Python literals.
* ``step3``: ``<steptml:invoke name="NAME">`` / ``<steptml:parameter name="K">`` inside Step's special tokens.
* ``kimi_k3``: Kimi K3's XTML channels, ``<|open|>tools<|sep|>`` ``<|open|>call tool="NAME" index="1"<|sep|>``
  ``<|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>`` ``<|close|>call<|sep|>``
  ``<|close|>tools<|sep|>``; a ``type="string"`` value (or one without a type) is raw text, any other type is
  JSON (its text when it does not parse). The ``response`` channel's markers are dropped: its text is content.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from render_service.parsers.tools_glm import GLM_FORMAT, Glm45ToolParser
from render_service.parsers.tools_minimax import MINIMAX_M2_FORMAT
from render_service.parsers.tools_wrapped import DroppedMarkersToolParser
from render_service.parsers.tools_xml import XmlFormat, XmlToolParser


class PoolsideV1ToolParser(Glm45ToolParser):
    name: ClassVar[str] = "poolside_v1"


# dots (dots.llm): MiniMax-M2's invoke/parameter markup inside <dots_function_call>
DOTS_FORMAT = msgspec.structs.replace(
    MINIMAX_M2_FORMAT, block_open="<dots_function_call>", block_end="</dots_function_call>")


class DotsToolParser(XmlToolParser):
    name: ClassVar[str] = "dots"
    FORMAT: ClassVar[XmlFormat] = DOTS_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<dots_function_call>\n"
    FORCED_NAMED: ClassVar[str] = "<dots_function_call>\n<invoke name=\"{name}\">\n"


# hy_v3 (Hunyuan v3): <tool_calls><tool_call>NAME<tool_sep><arg_key>K</arg_key><arg_value>V</arg_value>
# </tool_call></tool_calls>; undeclared values are JSON/Python literals when they parse (upstream's _deserialize)
HY_V3_FORMAT = msgspec.structs.replace(
    GLM_FORMAT, block_open="<tool_calls>", block_end="</tool_calls>", call_open="<tool_call>",
    head_ends=("<tool_sep>",), head_consumed=("<tool_sep>",), call_end="</tool_call>", skip_escaped_newlines=False)


class HyV3ToolParser(XmlToolParser):
    name: ClassVar[str] = "hy_v3"
    FORMAT: ClassVar[XmlFormat] = HY_V3_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<tool_calls><tool_call>"
    FORCED_NAMED: ClassVar[str] = "<tool_calls><tool_call>{name}<tool_sep>"


# hy_v4 (Hunyuan v4): <tool_calls><tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call></tool_calls>
HY_V4_FORMAT = msgspec.structs.replace(
    HY_V3_FORMAT, head_ends=GLM_FORMAT.head_ends, head_consumed=GLM_FORMAT.head_consumed, undeclared="string")


class HyV4ToolParser(XmlToolParser):
    name: ClassVar[str] = "hy_v4"
    FORMAT: ClassVar[XmlFormat] = HY_V4_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<tool_calls><tool_call>"
    FORCED_NAMED: ClassVar[str] = "<tool_calls><tool_call>{name}\n"


# k2_horizon (K2 Horizon): GLM's key/value markup in IFM tags, calls in a block
K2_HORIZON_FORMAT = msgspec.structs.replace(
    GLM_FORMAT, block_open="<ifm|tool_calls>", block_end="</ifm|tool_calls>", call_open="<ifm|tool_call>",
    head_ends=("\n", "<ifm|arg_key>", "</ifm|tool_call>"), call_end="</ifm|tool_call>", key_open="<ifm|arg_key>",
    key_end="</ifm|arg_key>", value_open="<ifm|arg_value>", value_end="</ifm|arg_value>", undeclared="string",
    skip_escaped_newlines=False)


class K2HorizonToolParser(XmlToolParser):
    name: ClassVar[str] = "k2_horizon"
    FORMAT: ClassVar[XmlFormat] = K2_HORIZON_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<ifm|tool_calls><ifm|tool_call>"
    FORCED_NAMED: ClassVar[str] = "<ifm|tool_calls><ifm|tool_call>{name}"


# minicpm5 (MiniCPM5): the call is the block, <function name="NAME"> ... </function>
MINICPM5_FORMAT = XmlFormat(
    block_open="<function name=",
    block_end="</function>",
    call_open=None,
    head_ends=(">",),
    head_consumed=(">",),
    call_end="</function>",
    key_open="<param name=",
    key_end=">",
    value_open=None,
    value_end="</param>",
    trim="strip",
    undeclared="json",
    quoted_names=True,
)


class MiniCPM5ToolParser(XmlToolParser):
    name: ClassVar[str] = "minicpm5"
    FORMAT: ClassVar[XmlFormat] = MINICPM5_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<function name="
    FORCED_NAMED: ClassVar[str] = "<function name=\"{name}\">"


# step3 (Step-3): <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME">
# <steptml:parameter name="K">V</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>. The
# outer section markers and each call's end marker are dropped (special tokens, ``tools_wrapped``); what is left
# is one block per call, the block being the call.
STEP3_FORMAT = XmlFormat(
    block_open="<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=",
    block_end="</steptml:invoke>",
    call_open=None,
    head_ends=(">",),
    head_consumed=(">",),
    call_end="</steptml:invoke>",
    key_open="<steptml:parameter name=",
    key_end=">",
    value_open=None,
    value_end="</steptml:parameter>",
    trim="strip",
    quoted_names=True,
)


class Step3CallsParser(XmlToolParser):
    name: ClassVar[str] = "step3_calls"
    FORMAT: ClassVar[XmlFormat] = STEP3_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<｜tool_call_begin｜>function<｜tool_sep｜>"
    FORCED_NAMED: ClassVar[str] = "<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"{name}\">"


class Step3ToolParser(DroppedMarkersToolParser):
    name: ClassVar[str] = "step3"
    DROPPED: ClassVar[tuple[str, ...]] = ("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>", "<｜tool_call_end｜>")
    INNER: ClassVar[Any] = Step3CallsParser


# kimi_k3 (Kimi K3): XTML elements built from the <|open|>, <|close|> and <|sep|> special tokens
K3_FORMAT = XmlFormat(
    block_open="<|open|>tools<|sep|>",
    block_end="<|close|>tools<|sep|>",
    call_open="<|open|>call tool=",
    head_ends=("<|sep|>",),
    head_consumed=("<|sep|>",),
    call_end="<|close|>call<|sep|>",
    key_open="<|open|>argument key=",
    key_end="<|sep|>",
    value_open=None,
    value_end="<|close|>argument<|sep|>",
    trim="none",
    quoted_names=True,
    string_attr=True,
    string_attr_raw=("type", "string"),
    string_attr_default_raw=True,
)


class KimiK3CallsParser(XmlToolParser):
    name: ClassVar[str] = "kimi_k3_calls"
    FORMAT: ClassVar[XmlFormat] = K3_FORMAT
    FORCED_REQUIRED: ClassVar[str] = "<|open|>tools<|sep|>"
    FORCED_NAMED: ClassVar[str] = "<|open|>tools<|sep|><|open|>call tool=\"{name}\" index=\"1\"<|sep|>"


class KimiK3ToolParser(DroppedMarkersToolParser):
    name: ClassVar[str] = "kimi_k3"
    # the response channel around the reply (its opener often ends the prompt): markup, its text is content
    DROPPED: ClassVar[tuple[str, ...]] = ("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                                          "<|close|>message<|sep|>")
    INNER: ClassVar[Any] = KimiK3CallsParser
