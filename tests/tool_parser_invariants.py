"""The two invariants every tool parser keeps, as reusable checks and hypothesis strategies.

1. At the end every emitted call's ``arguments`` is a JSON object, and the concatenated argument deltas of a
   streamed call equal its final arguments (streaming one token at a time == batch).
2. Nothing the model generated is lost: every character of the output is in content, reasoning or a tool call
   (name, id, arguments), markup aside. Checked on letters and digits (case-folded multiset), after removing
   the family's markup strings and escape sequences from the output.

Checks run at two levels: the parser alone (one feed == any chunking == one character per feed, each state
through a msgpack round trip), and the whole derender pipeline over real Qwen3 token IDs (batch derender ==
one-token streaming with stream_state round trips), outputs cut anywhere (``max_tokens``) included.

To check a new family: describe it with a ``ToolFamily`` (how its model writes calls, its markup, the pieces
adversarial outputs are built from) and add it to ``FAMILIES``; ``tests/test_tool_parser_invariants.py`` then
runs every property on it. A family with its own test file can call ``check_parser`` / ``check_pipeline`` and
draw from ``outputs(family)`` / ``token_soup(family)`` directly.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from render_service.parsers.base import ToolParserConfig
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from tests.family_bundles import GEMMA4_RESPONSE_TEMPLATE
from tests.test_tool_parsers_common import ARG_TEXT, WEATHER_TOOLS, Folded, parse, parse_chunks, split_at

Call = tuple[str, dict[str, Any]]  # (name, arguments as JSON values)


@dataclass(frozen=True)
class ToolFamily:
    """How one tool-parser family's model writes calls, for generated and adversarial outputs."""

    name: str  # the registry name (--tool-call-parser)
    write: Callable[[list[Call]], str]  # a well-formed output holding these calls
    markup: tuple[str, ...]  # strings that are markup, not the model's message
    vocabulary: tuple[str, ...]  # pieces adversarial outputs are built from (tags, fragments, punctuation)
    calls_first: bool = False  # the format is only recognised at the very start of the output
    tools: ToolParserConfig = field(default=WEATHER_TOOLS)
    # the bundle's response_template, for the families that read it (hf, beam)
    response_template: dict[str, Any] | None = None
    # spans that are markup whole, what they hold included (Cohere's citation closers, ``</co: 0:[1,2]>``)
    markup_spans: re.Pattern[str] | None = None


# --- writers ---------------------------------------------------------------------------------------------

def _args(a: dict[str, Any]) -> str:
    return json.dumps(a, ensure_ascii=False)


def _text_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def write_hermes(calls: list[Call]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {_args(a)}}}\n</tool_call>'
                     for n, a in calls)


def write_longcat(calls: list[Call]) -> str:
    return write_hermes(calls).replace("tool_call>", "longcat_tool_call>")


def _json_list(calls: list[Call]) -> str:
    return "[" + ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {_args(a)}}}' for n, a in calls) + "]"


def write_lfm2(calls: list[Call]) -> str:
    return "<|tool_call_start|>" + write_pythonic(calls) + "<|tool_call_end|>"


def write_jamba(calls: list[Call]) -> str:
    return "<tool_calls>" + _json_list(calls) + "</tool_calls>"


def write_phi4_mini(calls: list[Call]) -> str:
    return "functools" + _json_list(calls)


def write_internlm(calls: list[Call]) -> str:
    return "".join(f'<|action_start|><|plugin|>\n{{"name": {json.dumps(n)}, "parameters": {_args(a)}}}<|action_end|>'
                   for n, a in calls)


def write_dots(calls: list[Call]) -> str:
    return "".join("<dots_function_call>\n" + f'<invoke name="{n}">\n' + "".join(
        f'<parameter name="{k}">{_text_value(v)}</parameter>\n' for k, v in a.items()) + "</invoke>\n</dots_function_call>"
        for n, a in calls)


def write_hy_v3(calls: list[Call]) -> str:
    return "<tool_calls>" + "".join(f"<tool_call>{n}<tool_sep>" + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{_text_value(v)}</arg_value>" for k, v in a.items()) + "</tool_call>"
        for n, a in calls) + "</tool_calls>"


STEP3 = ("<｜tool_calls_begin｜>", "<｜tool_call_begin｜>", "<｜tool_sep｜>", "<｜tool_call_end｜>", "<｜tool_calls_end｜>")


def write_step3(calls: list[Call]) -> str:
    sb, cb, sep, ce, se = STEP3
    return sb + "".join(f'{cb}function{sep}<steptml:invoke name="{n}">' + "".join(
        f'<steptml:parameter name="{k}">{_text_value(v)}</steptml:parameter>' for k, v in a.items())
        + f"</steptml:invoke>{ce}" for n, a in calls) + se


def write_deepseek_v3(calls: list[Call]) -> str:
    b, cb, sep, ce, e = DS
    return b + "".join(f"{cb}function{sep}{n}\n```json\n{_args(a)}\n```{ce}" for n, a in calls) + e


def write_plamo3(calls: list[Call]) -> str:
    def m(x: str) -> str:
        return f"<|plamo:{x}:plamo|>"
    return m("begin_tool_requests") + "".join(
        m("begin_tool_request") + m("begin_tool_name") + n + m("end_tool_name") + m("begin_tool_arguments")
        + "<|plamo:constrain|>json<|plamo:msg|>" + _args(a) + m("end_tool_arguments") + m("end_tool_request")
        for n, a in calls) + m("end_tool_requests")


PLAMO = tuple(f"<|plamo:{x}:plamo|>" for x in (
    "begin_tool_requests", "end_tool_requests", "begin_tool_request", "end_tool_request", "begin_tool_name",
    "end_tool_name", "begin_tool_arguments", "end_tool_arguments")) + ("<|plamo:constrain|>", "<|plamo:msg|>")


def write_granite_20b_fc(calls: list[Call]) -> str:
    return " ".join(f'<function_call> {{"name": {json.dumps(n)}, "arguments": {_args(a)}}}' for n, a in calls)


def write_gigachat3(calls: list[Call]) -> str:
    return "".join(f'<|function_call|>{{"name": {json.dumps(n)}, "arguments": {_args(a)}}}' for n, a in calls)


def _gemma_value(v: Any, delim: str) -> str:
    if isinstance(v, str):
        return f"{delim}{v}{delim}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(x, delim)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma_value(x, delim) for x in v) + "]"
    return json.dumps(v)


def write_gemma4(calls: list[Call]) -> str:
    return "".join("<|tool_call>call:" + n + _gemma_value(a, '<|"|>') + "<tool_call|>" for n, a in calls)


def write_functiongemma(calls: list[Call]) -> str:
    return "".join("<start_function_call>call:" + n + "{" + ",".join(
        f"{k}:<escape>{_text_value(v)}<escape>" for k, v in a.items()) + "}<end_function_call>" for n, a in calls)


GEMMA4 = ("<|tool_call>", "<tool_call|>", '<|"|>', "call:")
FUNCTIONGEMMA = ("<start_function_call>", "<end_function_call>", "<escape>", "call:")


K3 = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>", "<|open|>call tool=", "<|close|>call<|sep|>",
      "<|open|>argument key=", "<|close|>argument<|sep|>", "<|sep|>", "<|open|>response<|sep|>",
      "<|close|>response<|sep|>", 'type="string"', 'type="json"', 'index="1"', 'index="2"', 'index="3"')


def write_kimi_k3(calls: list[Call]) -> str:
    return "<|open|>tools<|sep|>" + "".join(f'<|open|>call tool="{n}" index="{i + 1}"<|sep|>' + "".join(
        f'<|open|>argument key="{k}" type="{"string" if isinstance(v, str) else "json"}"<|sep|>{_text_value(v)}'
        "<|close|>argument<|sep|>" for k, v in a.items()) + "<|close|>call<|sep|>"
        for i, (n, a) in enumerate(calls)) + "<|close|>tools<|sep|>"


def write_olmo3(calls: list[Call]) -> str:
    return "<function_calls>" + "\n".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                                           for n, a in calls) + "</function_calls>"


def write_hy_v4(calls: list[Call]) -> str:
    return "<tool_calls>" + "".join(f"<tool_call>{n}\n" + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{_text_value(v)}</arg_value>" for k, v in a.items()) + "</tool_call>"
        for n, a in calls) + "</tool_calls>"


def write_apertus(calls: list[Call]) -> str:
    return "<|tools_prefix|>[" + ", ".join(f"{{{json.dumps(n)}: {_args(a)}}}" for n, a in calls) + "]<|tools_suffix|>"


def write_k2_horizon(calls: list[Call]) -> str:
    return "<ifm|tool_calls>" + "".join(f"<ifm|tool_call>{n}" + "".join(
        f"<ifm|arg_key>{k}</ifm|arg_key><ifm|arg_value>{_text_value(v)}</ifm|arg_value>" for k, v in a.items())
        + "</ifm|tool_call>" for n, a in calls) + "</ifm|tool_calls>"


K2H = ("<ifm|tool_calls>", "</ifm|tool_calls>", "<ifm|tool_call>", "</ifm|tool_call>", "<ifm|arg_key>",
       "</ifm|arg_key>", "<ifm|arg_value>", "</ifm|arg_value>")


def write_minicpm5(calls: list[Call]) -> str:
    return "".join(f'<function name="{n}">' + "".join(f'<param name="{k}">{_text_value(v)}</param>'
                                                      for k, v in a.items()) + "</function>" for n, a in calls)


# A citation closer: its source list (``0:[1,2],1:[3]``) is where the model cites from, not its message.
COHERE_CITATION_CLOSER = re.compile(r"</co:[ 0-9:,\[\]]*>")
COHERE = ("<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<co>", "</co:",
          '"tool_call_id"', '"tool_name"', '"parameters"', '"0"', '"1"', '"2"')


def write_cohere(calls: list[Call]) -> str:
    return "<|START_ACTION|>[" + ", ".join(
        f'{{"tool_call_id": "{i}", "tool_name": {json.dumps(n)}, "parameters": {_args(a)}}}'
        for i, (n, a) in enumerate(calls)) + "]<|END_ACTION|>"


INKLING = ("<|message_model|>", "<|content_text|>", "<|content_invoke_tool_json|>", "<|end_message|>",
           "<|content_model_end_sampling|>", '"name"', '"args"')


def write_inkling(calls: list[Call]) -> str:
    return "".join(f'<|message_model|><|content_invoke_tool_json|>{{"name": {json.dumps(n)}, "args": {_args(a)}}}'
                   "<|end_message|>" for n, a in calls)


M3NS = "]<]minimax[>["
M3 = (M3NS + "<tool_call>", M3NS + "</tool_call>", M3NS + "<invoke name=", M3NS + "</invoke>", M3NS, "item")


def _m3_value(v: Any) -> str:
    if isinstance(v, dict):
        return "".join(f"{M3NS}<{k}>{_m3_value(x)}{M3NS}</{k}>" for k, x in v.items())
    if isinstance(v, list):
        return "".join(f"{M3NS}<item>{_m3_value(x)}{M3NS}</item>" for x in v)
    return _text_value(v)


def write_minimax_m3(calls: list[Call]) -> str:
    return M3NS + "<tool_call>\n" + "".join(
        f'{M3NS}<invoke name="{n}">' + _m3_value(a) + f"{M3NS}</invoke>\n" for n, a in calls) + M3NS + "</tool_call>"


MUSE = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "assistant", "to=self", "to=user", "to=commentary",
        "<atem:function_calls>", "</atem:function_calls>", "<atem:invoke name=", "</atem:invoke>",
        "<atem:parameter name=", "</atem:parameter>",
        *(f"to={n}<|message|>" for n in ("get_weather", "get_time", "write_file", "unknown_tool")))


# A header's recipient: the ``to=NAME`` right before a ``<|message|>`` is where the message goes, not its text,
# whatever the name (``to=selfnull<|message|>`` is a message to a tool named so), as the parser reads it
MUSE_HEADER_RECIPIENT = re.compile(r"to=[A-Za-z0-9_.\-]*[^\S\n]*(?=<\|message\|>)")


def write_muse(calls: list[Call]) -> str:
    # one message to the tool per call, as Muse's template writes them
    return "".join(f"<|start|>assistant to={n}<|message|><atem:function_calls>\n<atem:invoke name=\"{n}\">\n" + "".join(
        f'<atem:parameter name="{k}">{_text_value(v)}</atem:parameter>\n' for k, v in a.items())
        + "</atem:invoke>\n</atem:function_calls><|eom|>" for n, a in calls)


def write_mimo(calls: list[Call]) -> str:
    return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
        f"<parameter={k}>{_text_value(v)}</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
        for n, a in calls)


def write_granite(calls: list[Call]) -> str:
    return "<|tool_call|>" + _json_list(calls)


def write_qwen3_xml(calls: list[Call]) -> str:
    out = []
    for n, a in calls:
        body = "".join(f"<parameter={k}>\n{_text_value(v)}\n</parameter>\n" for k, v in a.items())
        out.append(f"<tool_call>\n<function={n}>\n{body}</function>\n</tool_call>")
    return "\n".join(out)


def write_zaya_xml(calls: list[Call]) -> str:
    return write_qwen3_xml(calls).replace("tool_call>", "zyphra_tool_call>")


def write_llama3_json(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {_args(a)}}}' for n, a in calls)


def write_mistral(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}{_args(a)}" for n, a in calls)


DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")


def write_deepseek_v31(calls: list[Call]) -> str:
    b, cb, sep, ce, e = DS
    return b + "".join(f"{cb}{n}{sep}{_args(a)}{ce}" for n, a in calls) + e


def write_kimi_k2(calls: list[Call]) -> str:
    sb, cb, ab, ce, se = KIMI
    return sb + "".join(f"{cb}functions.{n}:{i}{ab}{_args(a)}{ce}" for i, (n, a) in enumerate(calls)) + se


def write_pythonic(calls: list[Call]) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def write_dsml(block: str, d: str = "\uff5cDSML\uff5c") -> Callable[[list[Call]], str]:
    def write(calls: list[Call]) -> str:
        invokes = "".join(
            f'<{d}invoke name="{n}">\n' + "".join(
                f'<{d}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">{_text_value(v)}'
                f"</{d}parameter>\n" for k, v in a.items()) + f"</{d}invoke>\n" for n, a in calls)
        return f"<{d}{block}>\n{invokes}</{d}{block}>"
    return write


def write_glm(calls: list[Call]) -> str:
    return "".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text_value(v)}</arg_value>\n"
                                                for k, v in a.items()) + "</tool_call>" for n, a in calls)


def write_minimax(calls: list[Call]) -> str:
    invokes = "".join(f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{_text_value(v)}</parameter>\n'
                                                        for k, v in a.items()) + "</invoke>\n" for n, a in calls)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def write_seed_oss(calls: list[Call]) -> str:
    return "".join(f"<seed:tool_call>\n<function={n}>\n" + "".join(
        f"<parameter={k}>{_text_value(v)}</parameter>\n" for k, v in a.items()) + "</function>\n</seed:tool_call>"
        for n, a in calls)


def write_llama4_pythonic(calls: list[Call]) -> str:
    return "<|python_start|>" + write_pythonic(calls) + "<|python_end|>"


_DSML_TAGS = tuple(f"{o}\uff5cDSML\uff5c{t}" for o in ("<", "</")
                   for t in ("tool_calls>", "function_calls>", "invoke name=", "invoke>", "parameter name=",
                             "parameter>"))
_DSML41_TAGS = tuple(f"{o}\uff5cDSML\uff5c {t}" for o in ("<", "</")
                     for t in ("calls>", "invoke name=", "invoke>", "parameter name=", "parameter>"))
_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_MINIMAX = ("<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", "</invoke>", "<parameter name=",
            "</parameter>")
_SEED = ("<seed:tool_call>", "</seed:tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


_ZAYA = ("<zyphra_tool_call>", "</zyphra_tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
_JSON_KEYS = ('"name"', '"arguments"', '"parameters"')
_QWEN_XML = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")

FAMILIES: dict[str, ToolFamily] = {f.name: f for f in [
    ToolFamily("hermes", write_hermes, ("<tool_call>", "</tool_call>", *_JSON_KEYS),
               ("<tool_call>", "</tool_call>", "<tool_", "{", "}", "[", "]", '"', "\\", ":", ",", '"name"',
                '"arguments"', '"parameters"', '"get_time"', " ", "\n", "x", "1", "<", '\\"', "\\u00e9", "😀",
                "tru", "null", '"{')),
    ToolFamily("qwen3_coder", write_qwen3_xml, _QWEN_XML,
               (*_QWEN_XML, "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "</param", "null",
                "😀", "{", "}")),
    ToolFamily("qwen3_xml", write_qwen3_xml, _QWEN_XML,
               (*_QWEN_XML, "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "</param", "null",
                "😀")),
    ToolFamily("qwen3_json", write_hermes, ("<tool_call>", "</tool_call>", *_JSON_KEYS),
               ("<tool_call>", "</tool_call>", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "\n", "x")),
    ToolFamily("step5", write_qwen3_xml, _QWEN_XML,
               (*_QWEN_XML, "get_weather", "city", "days", ">", "\n", " ", "x", "3", "<", "</param")),
    ToolFamily("llama3_json", write_llama3_json, ("<|python_tag|>", *_JSON_KEYS),
               ("<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":", ",", ";", '"name"', '"parameters"',
                '"f"', " ", "\n", "x", "1", "null"), calls_first=True),
    ToolFamily("mistral", write_mistral, ("[TOOL_CALLS]", "[ARGS]", *_JSON_KEYS),
               ("[TOOL_CALLS]", "[ARGS]", "[", "]", "{", "}", '"', "\\", ":", ",", '"name"', '"arguments"', "f",
                " ", "x", "1")),
    ToolFamily("deepseek_v31", write_deepseek_v31, DS,
               (*DS, "<｜tool", "f", "{", "}", '"', ":", " ", "\n", "x", "1", "[")),
    ToolFamily("kimi_k2", write_kimi_k2, (*KIMI, "<|tool_call_section_begin|>", "functions"),
               (*KIMI, "<|tool_call", "functions.get_time:0", "functions.f.0", "0", ":", ".", "{", "}", '"',
                " ", "\n", "x")),
    ToolFamily("pythonic", write_pythonic, ("None", "True", "False"),
               ("[", "]", "(", ")", "f", "g", "a", "=", "'", '"', "'''", "\\", ",", " ", "1", "None", "\\n",
                "\\x4", "{", "}", "😀", "b'", "1e999"), calls_first=True),
    # the newer parser families (and the XML families before them)
    ToolFamily("deepseek_v4", write_dsml("tool_calls"), (*_DSML_TAGS, 'string="true"', 'string="false"'),
               (*_DSML_TAGS, 'string="true">', 'string="false">', '"get_weather">', '"city" ', "\n", " ", "x",
                "3", "<", "{", "}", "null", "😀")),
    ToolFamily("deepseek_v32", write_dsml("function_calls"), (*_DSML_TAGS, 'string="true"', 'string="false"'),
               (*_DSML_TAGS, 'string="true">', 'string="false">', '"get_time">', '"days" ', "\n", " ", "x", "3",
                "<", "null")),
    ToolFamily("granite4", write_hermes, ("<tool_call>", "</tool_call>", *_JSON_KEYS),
               ("<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ":", ",", '"name"', '"arguments"',
                '"get_time"', " ", "\n", "x", "1", "<", "null", '"{')),
    ToolFamily("llama4_json", write_llama3_json, ("<|python_tag|>", *_JSON_KEYS),
               ("<|python_tag|>", "{", "}", '"', ":", ",", ";", '"name"', '"parameters"', '"f"', " ", "x", "1"),
               calls_first=True),
    ToolFamily("llama4_pythonic", write_llama4_pythonic,
               ("None", "True", "False", "<|python_start|>", "<|python_end|>"),
               ("<|python_start|>", "<|python_end|>", "<|python", "[", "]", "(", ")", "f", "a", "=", "'", ",", " ",
                "1", "None", "{", "}", "😀"), calls_first=True),
    ToolFamily("glm45", write_glm, _GLM, (*_GLM, "get_weather", "city", "\n", " ", "x", "3", "<", "null", "😀")),
    ToolFamily("poolside_v1", write_glm, _GLM, (*_GLM, "get_weather", "city", "\n", " ", "x", "3", "<", "null")),
    ToolFamily("longcat", write_longcat, ("<longcat_tool_call>", "</longcat_tool_call>", *_JSON_KEYS),
               ("<longcat_tool_call>", "</longcat_tool_call>", "{", "}", '"', ":", ",", '"name"', '"arguments"',
                " ", "\n", "x", "<")),
    ToolFamily("ernie45", write_hermes, ("<tool_call>", "</tool_call>", *_JSON_KEYS),
               ("<tool_call>", "</tool_call>", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "\n", "1")),
    ToolFamily("lfm2", write_lfm2, ("<|tool_call_start|>", "<|tool_call_end|>", "None", "True", "False"),
               ("<|tool_call_start|>", "<|tool_call_end|>", "[", "]", "(", ")", "=", ",", "'", '"', "get_weather",
                "city", " ", "\n", "x", "1", "None")),
    ToolFamily("jamba", write_jamba, ("<tool_calls>", "</tool_calls>", *_JSON_KEYS),
               ("<tool_calls>", "</tool_calls>", "[", "]", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "x")),
    ToolFamily("phi4_mini_json", write_phi4_mini, ("functools", *_JSON_KEYS),
               ("functools", "[", "]", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "\n", "x", "1")),
    ToolFamily("internlm", write_internlm, ("<|action_start|>", "<|plugin|>", "<|action_end|>", *_JSON_KEYS),
               ("<|action_start|><|plugin|>", "<|action_end|>", "{", "}", '"', ":", ",", '"name"', '"parameters"',
                " ", "\n", "x")),
    ToolFamily("dots", write_dots, ("<dots_function_call>", "</dots_function_call>", "<invoke name=", "</invoke>",
                                     "<parameter name=", "</parameter>"),
               ("<dots_function_call>", "</dots_function_call>", "<invoke name=", "</invoke>", "<parameter name=",
                "</parameter>", '"get_weather">', '"city">', "\n", " ", "x", "3", "<")),
    ToolFamily("hy_v3", write_hy_v3, ("<tool_calls>", "</tool_calls>", "<tool_call>", "</tool_call>", "<tool_sep>",
                                       "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
               ("<tool_calls>", "</tool_calls>", "<tool_call>", "</tool_call>", "<tool_sep>", "<arg_key>",
                "</arg_key>", "<arg_value>", "</arg_value>", "get_weather", "city", " ", "x", "3", "<")),
    ToolFamily("step3", write_step3, (*STEP3, "function", "<steptml:invoke name=", "</steptml:invoke>",
                                      "<steptml:parameter name=", "</steptml:parameter>"),
               (*STEP3, "function", "<steptml:invoke name=", "</steptml:invoke>", "<steptml:parameter name=",
                "</steptml:parameter>", '"get_weather">', '"city">', " ", "x", "3", "<")),
    ToolFamily("deepseek_v3", write_deepseek_v3, (*DS, "function", "```json", "```", *_JSON_KEYS),
               (*DS, "function", "```json", "```", "`", "get_weather", "\n", "{", "}", '"', ":", ",", " ", "x")),
    ToolFamily("ling3", write_glm, _GLM, (*_GLM, "get_weather", "city", "\n", " ", "x", "3", "<")),
    ToolFamily("mimo", write_mimo, _QWEN_XML, (*_QWEN_XML, "get_weather", "city", ">", "\n", " ", "x", "3", "<")),
    ToolFamily("deepseek_v41", write_dsml("calls", "\uff5cDSML\uff5c "), (*_DSML41_TAGS, 'string="true"',
                                                                         'string="false"'),
               (*_DSML41_TAGS, '"get_weather">',
                '"city" string="true">', "\n", " ", "x", "3", "<")),
    ToolFamily("plamo3", write_plamo3, (*PLAMO, "json", *_JSON_KEYS),
               (*PLAMO, "json", "get_weather", "{", "}", '"', ":", ",", " ", "x")),
    ToolFamily("hunyuan_a13b", write_jamba, ("<tool_calls>", "</tool_calls>", *_JSON_KEYS),
               ("<tool_calls>", "</tool_calls>", "[", "]", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ")),
    ToolFamily("step3p5", write_qwen3_xml, _QWEN_XML, (*_QWEN_XML, "get_weather", "city", ">", "\n", " ", "x")),
    ToolFamily("granite-20b-fc", write_granite_20b_fc, ("<function_call>", *_JSON_KEYS),
               ("<function_call>", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "\n", "x")),
    ToolFamily("gigachat3", write_gigachat3, ("<|function_call|>", *_JSON_KEYS),
               ("<|function_call|>", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "x")),
    ToolFamily("xlam", lambda calls: _json_list(calls), _JSON_KEYS,
               ("[", "]", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "\n", "x", "1"), calls_first=True),
    ToolFamily("granite", write_granite, ("<|tool_call|>", "<tool_call>", *_JSON_KEYS),
               ("<|tool_call|>", "<tool_call>", "[", "]", "{", "}", '"', ":", ",", '"name"', '"arguments"', " ", "x")),
    ToolFamily("granite_toolcall_parser", write_qwen3_xml, _QWEN_XML,
               (*_QWEN_XML, "get_weather", "city", ">", "\n", " ", "x")),
    ToolFamily("cohere_command3", write_cohere, COHERE,
               (*COHERE, "[", "]", "{", "}", '"', ":", ",", " ", "\n", "x", "1", "</co:", ">", '"get_weather"'),
               markup_spans=COHERE_CITATION_CLOSER),
    ToolFamily("cohere_command4", write_cohere, COHERE,
               (*COHERE, "[", "]", "{", "}", '"', ":", ",", " ", "\n", "x", "1", "</co:", ">", '"get_weather"'),
               markup_spans=COHERE_CITATION_CLOSER),
    ToolFamily("minimax_m3", write_minimax_m3, M3,
               (*M3, "<city>", "</city>", '"get_weather">', "\n", " ", "x", "3", "<", ">", "[", "]")),
    ToolFamily("inkling", write_inkling, INKLING,
               (*INKLING, "{", "}", '"', ":", ",", " ", "\n", "x", "1", '"get_weather"')),
    ToolFamily("zaya_xml", write_zaya_xml, _ZAYA, (*_ZAYA, "get_weather", "city", ">", "\n", " ", "x", "3", "<")),
    ToolFamily("ripple", write_hermes, ("<tool_call>", "</tool_call>", *_JSON_KEYS),
               ("<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"', ":", ",", '"name"',
                '"arguments"', " ", "\n", "x", "1")),
    # the template's other fields' delimiters are markup too
    *[ToolFamily(name, write_gemma4, (*GEMMA4, "true", "false", "<|channel>thought\n", "<channel|>", "<turn|>",
                                      "<|tool_response>", "<eos>"),
                 (*GEMMA4, "get_weather", "city", "days", "{", "}", "[", "]", ":", ",", " ", "\n", "x", "3", "1.5",
                  "true", "<|", "<", "<|channel>thought\n", "<channel|>", "<turn|>"),
                 response_template=GEMMA4_RESPONSE_TEMPLATE) for name in ("hf", "beam")],
    ToolFamily("zaya", write_zaya_xml, _ZAYA, (*_ZAYA, "get_weather", "city", ">", "\n", " ", "x", "3", "<")),
    ToolFamily("minicpm5", write_minicpm5, ("<function name=", "</function>", "<param name=", "</param>"),
               ("<function name=", "</function>", "<param name=", "</param>", '"get_weather">', '"city">', " ", "\n",
                "x", "3", "<", ">")),
    ToolFamily("k2_horizon", write_k2_horizon, K2H, (*K2H, "get_weather", "city", "\n", " ", "x", "3", "<")),
    ToolFamily("apertus", write_apertus, ("<|tools_prefix|>", "<|tools_suffix|>"),
               ("<|tools_prefix|>", "<|tools_suffix|>", "[", "]", "{", "}", '"get_weather"', '"city"', ":", ",", '"',
                " ", "\n", "x", "1")),
    ToolFamily("hy_v4", write_hy_v4, ("<tool_calls>", "</tool_calls>", "<tool_call>", "</tool_call>", "<arg_key>",
                                       "</arg_key>", "<arg_value>", "</arg_value>"),
               ("<tool_calls>", "</tool_calls>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                "<arg_value>", "</arg_value>", "get_weather", "city", "\n", " ", "x", "3", "<")),
    ToolFamily("olmo3", write_olmo3, ("<function_calls>", "</function_calls>", "None", "True", "False"),
               ("<function_calls>", "</function_calls>", "get_weather", "(", ")", "=", "'", '"', ",", "\n", " ", "x",
                "1", "null", "true", "{", "}", "[", "]", "city")),
    ToolFamily("kimi_k3", write_kimi_k3, K3,
               (*K3, '"get_weather" index="1"', '"city" ', "\n", " ", "x", "3", "<|open|>", "<|close|>", "<", "{")),
    ToolFamily("gemma4", write_gemma4, (*GEMMA4, "true", "false"),
               (*GEMMA4, "get_weather", "city", "days", "{", "}", "[", "]", ":", ",", " ", "\n", "x", "3", "1.5",
                "true", "<|", "<", "😀")),
    ToolFamily("functiongemma", write_functiongemma, FUNCTIONGEMMA,
               (*FUNCTIONGEMMA, "get_weather", "city", "{", "}", ":", ",", " ", "x", "3", '"a"', "[1]", "<")),
    ToolFamily("glm47", write_glm, _GLM, (*_GLM, "get_time", "days", "\\n", " ", "x", "3", "<", "null")),
    ToolFamily("minimax_m2", write_minimax, _MINIMAX,
               (*_MINIMAX, '"get_weather">', '"city">', "\n", " ", "x", "3", "<", "null", "😀")),
    ToolFamily("seed_oss", write_seed_oss, _SEED,
               (*_SEED, "get_weather>", "city>", "\n", " ", "x", "3", "<", "null", "😀")),
    *(ToolFamily(name, write_muse, MUSE,
                 (*MUSE, " to=self<|message|>", "to=get_weather<|message|>", "<|start|>assistant to=user<|message|>",
                  '"get_weather">', '"city">', "\n", " ", "x", "t", "to", "3", "<", "<|", "null"),
                 markup_spans=MUSE_HEADER_RECIPIENT)
      for name in ("muse", "musespark", "muse_glimmer")),
]}


# --- strategies ------------------------------------------------------------------------------------------

_KEYS = st.sampled_from(["city", "days", "metric", "content", "q", "note"])
_VALUES = st.one_of(ARG_TEXT, st.integers(-10**6, 10**6), st.booleans(), st.none(),
                    st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.sampled_from(["k", "v"]), ARG_TEXT,
                                                                            max_size=2))
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "get_time", "write_file", "unknown_tool"]),
                           st.dictionaries(_KEYS, _VALUES, max_size=3)), min_size=1, max_size=3)
PROSE = st.text(alphabet=st.sampled_from(list("Ok, sure. 東😀\n<>/=")), max_size=12)


@st.composite
def outputs(draw: st.DrawFn, family: ToolFamily) -> str:
    """A realistic output (prose, calls, prose), half of them cut anywhere as max_tokens would."""
    before = "" if family.calls_first and draw(st.booleans()) else draw(PROSE)
    text = before + family.write(draw(CALLS)) + draw(PROSE)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def token_soup(draw: st.DrawFn, family: ToolFamily) -> str:
    """Random sequences of the format's pieces: mostly malformed, which is where hold-back bugs live."""
    return "".join(draw(st.lists(st.sampled_from(family.vocabulary), max_size=30)))


# --- checks ----------------------------------------------------------------------------------------------

_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[^}]*\}|.)", re.S)


def _letters(text: str) -> collections.Counter[str]:
    return collections.Counter(c for c in text.casefold() if c.isalnum())


def assert_arguments_are_objects(calls: list[dict[str, Any]]) -> None:
    for call in calls:
        assert isinstance(json.loads(call["arguments"]), dict), call


def assert_nothing_lost(family: ToolFamily, text: str, seen: list[str]) -> None:
    # Markup first: a backslash right before a tag ("\\</parameter>") is a value's last character, and taken
    # as an escape it would eat the tag's "<" and leave the tag's letters behind as if lost.
    raw = family.markup_spans.sub(" ", text) if family.markup_spans is not None else text
    for tag in sorted(family.markup, key=len, reverse=True):
        raw = raw.replace(tag, " ")
    raw = _ESCAPE.sub(" ", raw)
    missing = _letters(raw) - _letters(" ".join(seen))
    assert not missing, f"{family.name} lost {dict(missing)} of {text!r}: {seen}"


def _seen_of_calls(calls: list[dict[str, Any]]) -> list[str]:
    seen = []
    for call in calls:
        seen += [call.get("name") or "", call.get("id") or "", call["arguments"]]
        seen.append(json.dumps(json.loads(call["arguments"]), ensure_ascii=False))
    return seen


def check_parser(family: ToolFamily, text: str, cuts: list[int]) -> Folded:
    """The parser alone: one feed == random chunks == one character per feed; both invariants."""
    whole = parse(family.name, text, family.tools)
    assert parse_chunks(family.name, split_at(text, cuts), family.tools) == whole
    assert parse_chunks(family.name, list(text), family.tools) == whole
    assert_arguments_are_objects(whole.calls)
    assert_nothing_lost(family, text, [whole.content or "", whole.reasoning or "", *_seen_of_calls(whole.calls)])
    return whole


def _stream_one_token_at_a_time(pipeline: Pipeline, ids: list[int]) -> dict[str, Any]:
    import msgspec

    from render_service.parsers.pipeline import MessageAccumulator

    state = pipeline.initial_state(None, False)
    acc = MessageAccumulator()
    for i in ids:
        state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
        acc.add(pipeline.feed(state, [i]))
    acc.add(pipeline.finish(state))
    return acc.message()


class _WithMetadata:
    """A tokenizer that also carries a response_template (a bundle's tokenizer_config sets it at load)."""

    def __init__(self, tokenizer: Any, response_template: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self.response_template = response_template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def check_pipeline(family: ToolFamily, tokenizer: Any, ids: list[int]) -> dict[str, Any]:
    """Derender over real token IDs: batch == one-token streaming (state round trips); both invariants."""
    config = PipelineConfig(request_id="inv", tool_parser=family.name, tool_choice="auto",
                            tools=list(family.tools.tools), skip_special_tokens=False)
    pipeline = Pipeline(_WithMetadata(tokenizer, family.response_template) if family.response_template else tokenizer,
                        config)
    batch, _ = derender_all(pipeline, ids, None, False)
    assert _stream_one_token_at_a_time(pipeline, ids) == batch
    calls = [{"name": c["function"]["name"], "id": c["id"], "arguments": c["function"]["arguments"]}
             for c in batch["tool_calls"]]
    assert_arguments_are_objects(calls)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert_nothing_lost(family, text, [batch["content"] or "", batch["reasoning"] or "", *_seen_of_calls(calls)])
    return batch
