"""Families whose calls sit in their own markers, read by an inner parser (``tools_wrapped``): declarations.

* ``lfm2`` (LiquidAI LFM2 / LFM2.5): ``<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>``,
  pythonic calls (``tools_pythonic``'s rules) between special tokens, content before and after.
* ``jamba`` (AI21 Jamba): ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>``.
* ``phi4_mini_json`` (Phi-4-mini): ``functools[{"name": ..., "arguments": {...}}, ...]``; the list runs to its
  ``]`` and what follows is content.
* ``hunyuan_a13b`` (Hunyuan-A13B): Jamba's ``<tool_calls>[...]</tool_calls>``.
* ``granite-20b-fc`` (Granite-20B-FunctionCalling): ``<function_call> {"name": ..., "arguments": ...}`` per
  call, each opened by its marker, no closing one.
* ``gigachat3`` (GigaChat 3): ``<|function_call|>{"name": ..., "arguments": ...}`` (also spelled
  ``function call<|role_sep|>\n``), to the end of the output.
* ``granite`` (Granite 3.0 / 3.1): ``<|tool_call|>`` (3.0, a special token) or ``<tool_call>`` (3.1, text) and a
  JSON list of calls; the list's ``]`` ends it, prose around it is content.
* ``apertus`` (Apertus): ``<|tools_prefix|>[{"get_weather": {"city": "Paris"}}, ...]<|tools_suffix|>``, each call an
  object whose one key is the name and whose value is the arguments.
* ``cohere_command3`` / ``cohere_command4`` (Command A / Command A Reasoning): ``<|START_ACTION|>[{"tool_call_id":
  "0", "tool_name": "NAME", "parameters": {...}}, ...]<|END_ACTION|>``; the response wrapper
  (``<|START_RESPONSE|>`` .. ``<|END_RESPONSE|>``, ``<|START_TEXT|>`` .. ``<|END_TEXT|>``) and the citation markup
  (``<co>`` .. ``</co: 0:[1,2]>``) are dropped, their text is content; the model's ``tool_call_id`` is markup.
* ``inkling`` (Inkling): typed blocks, ``<|message_model|><|content_invoke_tool_json|>{"name": ..., "args": {...}}``
  ``<|end_message|>`` a call; the role and block-kind markers, and ``<|end_message|>`` outside a call, are dropped.
* ``olmo3`` (OLMo 3): ``<function_calls>get_weather(city="Paris")\nget_time()</function_calls>``, pythonic calls
  one per line, ``null``/``true``/``false`` read as JSON's.
* ``internlm`` (InternLM2/2.5): ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>``.

The JSON families accept ``arguments`` or ``parameters`` (upstream's parsers read either), arguments stream as
the model's guarded text (``json_guard``), a list's brackets and commas are markup.
"""

from __future__ import annotations

from typing import Any, ClassVar

from render_service.parsers.call_object import CallKeys
from render_service.parsers.tools_json import JsonListToolParser, JsonObjectsToolParser
from render_service.parsers.tools_pythonic import PythonicToolParser
from render_service.parsers.tools_wrapped import DroppedMarkersToolParser, WrappedToolParser


class Lfm2ToolParser(WrappedToolParser):
    name: ClassVar[str] = "lfm2"
    START: ClassVar[str] = "<|tool_call_start|>"
    END: ClassVar[str | None] = "<|tool_call_end|>"
    INNER: ClassVar[Any] = PythonicToolParser


class JambaToolParser(WrappedToolParser):
    name: ClassVar[str] = "jamba"
    START: ClassVar[str] = "<tool_calls>"
    END: ClassVar[str | None] = "</tool_calls>"
    INNER: ClassVar[Any] = JsonListToolParser


class Phi4MiniJsonToolParser(WrappedToolParser):
    name: ClassVar[str] = "phi4_mini_json"
    START: ClassVar[str] = "functools"
    END: ClassVar[str | None] = None
    INNER: ClassVar[Any] = JsonListToolParser


class InternLMToolParser(WrappedToolParser):
    name: ClassVar[str] = "internlm"
    START: ClassVar[str] = "<|action_start|><|plugin|>"
    END: ClassVar[str | None] = "<|action_end|>"
    INNER: ClassVar[Any] = JsonObjectsToolParser


class HunyuanA13BToolParser(JambaToolParser):
    name: ClassVar[str] = "hunyuan_a13b"  # the same <tool_calls>[...]</tool_calls> list as Jamba


class Granite20bFCToolParser(WrappedToolParser):
    name: ClassVar[str] = "granite-20b-fc"
    START: ClassVar[str] = "<function_call>"
    END: ClassVar[str | None] = None
    START_ENDS_BLOCK: ClassVar[bool] = True
    INNER: ClassVar[Any] = JsonObjectsToolParser


class GigaChat3ToolParser(WrappedToolParser):
    name: ClassVar[str] = "gigachat3"
    START: ClassVar[str] = "<|function_call|>"
    OTHER_STARTS: ClassVar[tuple[str, ...]] = ("function call<|role_sep|>\n",)
    END: ClassVar[str | None] = None
    START_ENDS_BLOCK: ClassVar[bool] = True  # the model writes one call a message; a second marker opens another
    INNER: ClassVar[Any] = JsonObjectsToolParser


class GraniteToolParser(WrappedToolParser):
    name: ClassVar[str] = "granite"
    START: ClassVar[str] = "<|tool_call|>"
    OTHER_STARTS: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    END: ClassVar[str | None] = None
    INNER: ClassVar[Any] = JsonListToolParser


class Olmo3CallsParser(PythonicToolParser):
    name: ClassVar[str] = "olmo3_calls"
    BRACKETED: ClassVar[bool] = False
    JSON_NAMES: ClassVar[bool] = True


class Olmo3ToolParser(WrappedToolParser):
    name: ClassVar[str] = "olmo3"
    START: ClassVar[str] = "<function_calls>"
    END: ClassVar[str | None] = "</function_calls>"
    INNER: ClassVar[Any] = Olmo3CallsParser


class ApertusCallsParser(JsonListToolParser):
    name: ClassVar[str] = "apertus_calls"
    KEYS: ClassVar[CallKeys] = CallKeys(name_is_key=True)


class ApertusToolParser(WrappedToolParser):
    name: ClassVar[str] = "apertus"
    START: ClassVar[str] = "<|tools_prefix|>"
    END: ClassVar[str | None] = "<|tools_suffix|>"
    INNER: ClassVar[Any] = ApertusCallsParser


class CohereCallsParser(JsonListToolParser):
    name: ClassVar[str] = "cohere_calls"
    KEYS: ClassVar[CallKeys] = CallKeys(name="tool_name", markup=("tool_call_id",))


class CohereActionToolParser(WrappedToolParser):
    name: ClassVar[str] = "cohere_action"
    START: ClassVar[str] = "<|START_ACTION|>"
    END: ClassVar[str | None] = "<|END_ACTION|>"
    INNER: ClassVar[Any] = CohereCallsParser


class CohereCommand3ToolParser(DroppedMarkersToolParser):
    name: ClassVar[str] = "cohere_command3"
    DROPPED: ClassVar[tuple[str, ...]] = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>",
                                          "<co>")
    DROPPED_SPANS: ClassVar[tuple[tuple[str, str], ...]] = (("</co:", ">"),)
    SPAN_CHARS: ClassVar[str] = " 0123456789:,[]"  # a citation closer's source list, 0:[1,2],1:[3]
    INNER: ClassVar[Any] = CohereActionToolParser


class CohereCommand4ToolParser(CohereCommand3ToolParser):
    name: ClassVar[str] = "cohere_command4"  # the same markup (upstream: cohere_melody's cmd4 options)


INKLING_MARKERS = ("<|message_model|>", "<|content_text|>", "<|content_model_end_sampling|>",
                   "<|content_invoke_tool_text|>", "<|content_tool_error|>")


class InklingCallsParser(JsonObjectsToolParser):
    name: ClassVar[str] = "inkling_calls"
    ARG_KEYS: ClassVar[tuple[str, ...]] = ("args", "arguments", "parameters")


class InklingBlocksParser(WrappedToolParser):
    name: ClassVar[str] = "inkling_blocks"
    START: ClassVar[str] = "<|content_invoke_tool_json|>"
    END: ClassVar[str | None] = "<|end_message|>"
    OUTSIDE_DROPPED: ClassVar[tuple[str, ...]] = ("<|end_message|>",)
    INNER: ClassVar[Any] = InklingCallsParser


class InklingToolParser(DroppedMarkersToolParser):
    name: ClassVar[str] = "inkling"
    DROPPED: ClassVar[tuple[str, ...]] = INKLING_MARKERS
    INNER: ClassVar[Any] = InklingBlocksParser
