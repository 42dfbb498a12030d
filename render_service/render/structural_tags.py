"""The structural tags vLLM 0.32/0.33 put on tool calls, per tool parser, built here as plain data.

vLLM's render constrains a forced call (and, with a strict tool, an "auto" one) to the model's own call syntax:
a structural tag (xgrammar's format language) whose shape follows the parser family and whose content follows
from the tools. These builders write the same JSON, key for key, as vLLM's render servers answered for every
parser in tests/fixtures/vllm_tool_constraints/ (recorded by tests/vllm_tool_constraints.py). The render tier
only writes the tag; the engine (ours or vLLM's) compiles it with xgrammar.

A family builder takes the tools the tag may call (strictness already resolved) and a choice: "auto" (calls
optional), "required" (at least one) or "forced" (the one named tool).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

TagChoice = Literal["auto", "required", "forced"]
Node = dict[str, Any]

THINK_TAGS: Final = ["<think>", "</think>"]
# the free-text spans around GLM calls may not hold its control tokens (but the trigger itself)
GLM_TEXT_EXCLUDES: Final = ["<think>", "</think>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                            "</arg_value>"]
GLM_VALUE_EXCLUDES: Final = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                             "<arg_value>", "</arg_value>"]
_LIST_FORMATS: Final = frozenset({"triggered_tags", "tags_with_separator", "token_triggered_tags"})


@dataclass(frozen=True)
class TagTool:
    """A function tool as a tag sees it: ``strict`` is resolved (the tool's own flag or the server's level)."""

    name: str
    parameters: Any  # the tool's JSON schema, or None
    strict: bool

    @property
    def schema(self) -> Any:
        """What the arguments are held to: the schema for a strict tool, any JSON value (``true``) otherwise."""
        return self.parameters if self.strict and self.parameters is not None else True


# ---- format nodes, each with the keys (and defaults) in the order vLLM serializes them ----------------------


def json_schema(schema: Any, style: str = "json") -> Node:
    return {"type": "json_schema", "json_schema": schema, "style": style, "any_order": False,
            "max_whitespace_cnt": None, "excludes": []}


def const(value: str) -> Node:
    return {"type": "const_string", "value": value}


def any_text(excludes: list[str]) -> Node:
    return {"type": "any_text", "excludes": list(excludes), "max_tokens": None, "max_chars": None}


def tag(begin: str, content: Node, end: str | list[str]) -> Node:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def sequence(*elements: Node) -> Node:
    return {"type": "sequence", "elements": list(elements)}


def one_of(elements: list[Node]) -> Node:
    return {"type": "or", "elements": elements}


def regex(pattern: str) -> Node:
    return {"type": "regex", "pattern": pattern}


def grammar(ebnf: str) -> Node:
    return {"type": "grammar", "grammar": ebnf}


def triggered(triggers: list[str], tags: list[Node], at_least_one: bool, excludes: list[str]) -> Node:
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": at_least_one,
            "stop_after_first": False, "excludes": list(excludes)}


def separated(tags: list[Node], at_least_one: bool = True, stop_after_first: bool = False) -> Node:
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": at_least_one,
            "stop_after_first": stop_after_first}


def structural_tag_text(fmt: Node) -> str:
    """The ``structured_outputs.structural_tag`` string, as vLLM writes it (``json.dumps`` defaults)."""
    return json.dumps({"type": "structural_tag", "format": fmt})


def one_call_only(fmt: Node) -> Node:
    """``parallel_tool_calls: false``: every list of calls in the tag stops after its first (in place)."""
    if fmt.get("type") in _LIST_FORMATS:
        fmt["stop_after_first"] = True
    for key, value in fmt.items():
        if key == "json_schema":  # a schema, not a format
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, dict):
                one_call_only(child)
    return fmt


# ---- the families -----------------------------------------------------------------------------------------


def _flat(tags: list[Node], choice: TagChoice, trigger: str, excludes: list[str]) -> Node:
    """Calls side by side, each its own tag: a forced call is its tag alone, else calls triggered in text."""
    if choice == "forced":
        return tags[0]
    return triggered([trigger], tags, choice == "required", excludes)


def hermes(tools: list[TagTool], choice: TagChoice) -> Node:
    """``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, with or without the newlines."""
    tags = [tag(start + '{"name": "' + t.name + '", "arguments": ', json_schema(t.schema), end)
            for t in tools for start, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))]
    if choice == "auto":
        return triggered(["<tool_call>"], tags, False, [])
    return separated(tags, stop_after_first=choice == "forced")


def qwen3_coder(tools: list[TagTool], choice: TagChoice) -> Node:
    """Qwen3-Coder's XML: ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>...</tool_call>``."""
    tags = [tag(f"<tool_call>\n<function={t.name}>\n", json_schema(t.schema, "qwen_xml"), "\n</function>\n</tool_call>")
            for t in tools]
    return _flat(tags, choice, "<tool_call>\n<function=", THINK_TAGS)


def llama(tools: list[TagTool], choice: TagChoice) -> Node:
    """Llama 3's JSON: ``{"name": N, "parameters": {...}}``."""
    tags = [tag('{"name": "' + t.name + '", "parameters": ', json_schema(t.schema), "}") for t in tools]
    return _flat(tags, choice, '{"name": ', THINK_TAGS)


def deepseek_v31(tools: list[TagTool], choice: TagChoice) -> Node:
    """DeepSeek-V3.1: calls inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, arguments as JSON."""
    block, block_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    if choice == "forced":
        return tag(block + call + tools[0].name + sep, json_schema(tools[0].schema), call_end + block_end)
    calls = tag(block, separated([tag(call + t.name + sep, json_schema(t.schema), call_end) for t in tools]),
                block_end)
    return calls if choice == "required" else triggered([block], [calls], False, THINK_TAGS)


def _in_block(calls: list[Node], choice: TagChoice, trigger: str, opening: str, closing: str, lead: str,
              excludes: list[str], forced_as_list: bool = False) -> Node:
    """Calls inside one block that opens with ``opening`` (``lead`` before it when the block is required)."""
    if choice == "auto":
        return triggered([trigger], [tag(opening, separated(calls), closing)], False, excludes)
    if choice == "forced" and not forced_as_list:
        return sequence(const(lead + opening), calls[0], const(closing))
    return sequence(const(lead + opening), separated(calls, stop_after_first=choice == "forced"), const(closing))


def kimi(tools: list[TagTool], choice: TagChoice) -> Node:
    """Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}``."""
    calls = [tag(f"<|tool_call_begin|>functions.{t.name}:",
                 sequence(regex(r"\d+"), const("<|tool_call_argument_begin|>"), json_schema(t.schema)),
                 "<|tool_call_end|>") for t in tools]
    section = "<|tool_calls_section_begin|>"
    return _in_block(calls, choice, section, section, "<|tool_calls_section_end|>", "",
                     [*THINK_TAGS, "<|tool_call_begin|>"])


def _dsml(block: str) -> Callable[[list[TagTool], TagChoice], Node]:
    """DeepSeek-V3.2 / V4's DSML: ``<｜DSML｜invoke name="N">`` with one parameter element per argument."""

    def build(tools: list[TagTool], choice: TagChoice) -> Node:
        calls = [tag(f'<｜DSML｜invoke name="{t.name}">\n', json_schema(t.schema, "deepseek_xml"),
                     "</｜DSML｜invoke>\n") for t in tools]
        trigger = f"<｜DSML｜{block}>"
        return _in_block(calls, choice, trigger, trigger + "\n", f"</｜DSML｜{block}>", "\n\n", THINK_TAGS)

    return build


def minimax(tools: list[TagTool], choice: TagChoice) -> Node:
    """MiniMax-M2: ``<minimax:tool_call>\\n<invoke name="N">\\n<parameter name="K">V</parameter>...``."""
    calls = [tag(f'<invoke name="{t.name}">\n', json_schema(t.schema, "minimax_xml"), "</invoke>\n") for t in tools]
    return _in_block(calls, choice, "<minimax:tool_call>", "<minimax:tool_call>\n", "</minimax:tool_call>", "\n",
                     THINK_TAGS, forced_as_list=True)


def glm(tools: list[TagTool], choice: TagChoice) -> Node:
    """GLM-4.5/4.7: ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``. With every tool
    strict, the arguments follow each schema; otherwise a tool that is not strict gets its keys and the basic
    type of each value pinned, and the calls are a list (as vLLM builds it)."""
    if tools and all(t.strict for t in tools):
        tags = [tag("<tool_call>" + t.name, json_schema(t.schema, "glm_xml"), "</tool_call>") for t in tools]
        return _flat(tags, choice, "<tool_call>", GLM_TEXT_EXCLUDES)
    tags = [tag("<tool_call>" + t.name, json_schema(t.schema, "glm_xml"), "</tool_call>") if t.strict
            else _glm_shallow_tag(t) for t in tools]
    if choice == "auto":
        return triggered(["<tool_call>"], tags, False, GLM_TEXT_EXCLUDES)
    return separated(tags, stop_after_first=choice == "forced")


def _glm_shallow_tag(tool: TagTool) -> Node:
    params = tool.parameters if isinstance(tool.parameters, dict) else {}
    properties = params.get("properties")
    plain = params.get("additionalProperties") is not True and not any(
        k in params for k in ("$ref", "allOf", "anyOf", "oneOf", "patternProperties"))
    if not isinstance(properties, dict) or not properties or not plain:
        return tag("<tool_call>" + tool.name, json_schema(True, "glm_xml"), "</tool_call>")
    pairs = [sequence(const(f"<arg_key>{key}</arg_key><arg_value>"), _glm_value(prop), const("</arg_value>"))
             for key, prop in properties.items()]
    return tag("<tool_call>" + tool.name, {"type": "star", "content": pairs[0] if len(pairs) == 1 else one_of(pairs)},
               "</tool_call>")


def _glm_value(prop: Any) -> Node:
    """A GLM argument value: strings as raw text, enums as their spellings, other types as bare JSON."""
    prop = prop if isinstance(prop, dict) else {}
    if "enum" in prop and isinstance(prop["enum"], list):
        values = [const(v if isinstance(v, str) else json.dumps(v)) for v in prop["enum"]]
        return values[0] if len(values) == 1 else one_of(values)
    kind = prop.get("type")
    if isinstance(kind, list):
        formats = [_glm_value({"type": k}) for k in kind if k != "string"]
        if "string" in kind or not formats:
            formats.append(any_text(GLM_VALUE_EXCLUDES))
        return formats[0] if len(formats) == 1 else one_of(formats)
    if kind is None or kind == "string":
        return any_text(GLM_VALUE_EXCLUDES)
    return json_schema({"type": kind})


# gpt-oss (Harmony): a reply is an optional analysis message, an optional commentary preamble, then the constrained
# message. A call may name its recipient before or after the channel, in any of three channels, with or without
# <|constrain|>; a message ends at <|end|> or at a stop token (the "" end: <|call|>, <|return|>).
HARMONY_END: Final = ["<|end|>", ""]
HARMONY_JSON: Final = (" json", " <|constrain|>json")
HARMONY_CALL_CHANNELS: Final = ("<|channel|>commentary", "<|channel|>analysis", "<|channel|>final")


def harmony(tools: list[TagTool], choice: TagChoice) -> Node:
    """gpt-oss's calls, and under "auto" a final answer instead."""
    openings = (" to=functions.{name}{channel}{constrain}<|message|>",
                "{channel} to=functions.{name}{constrain}<|message|>")
    messages = [tag(opening.format(name=t.name, channel=channel, constrain=constrain), json_schema(t.schema),
                    list(HARMONY_END))
                for t in tools for opening in openings for constrain in HARMONY_JSON
                for channel in HARMONY_CALL_CHANNELS]
    if choice == "auto":
        messages += [tag(f"<|channel|>final{constrain}<|message|>", any_text([]), list(HARMONY_END))
                     for constrain in (*HARMONY_JSON, "")]
    return harmony_reply(one_of(messages), preamble=True)


def harmony_answer(answer: Node) -> Node:
    """A requested format as gpt-oss's final message (a JSON one announced as such, either spelling)."""
    if answer.get("type") == "json_schema":
        return harmony_reply(one_of([tag(f"<|channel|>final{constrain}<|message|>", answer, list(HARMONY_END))
                                     for constrain in HARMONY_JSON]), preamble=False)
    return harmony_reply(tag("<|channel|>final<|message|>", answer, list(HARMONY_END)), preamble=False)


def harmony_reply(last: Node, preamble: bool) -> Node:
    def optional(channel: str) -> Node:
        message = tag(f"<|channel|>{channel}<|message|>", any_text([]), "<|end|>")
        return {"type": "optional", "content": sequence(message, const("<|start|>assistant"))}

    return sequence(optional("analysis"), *([optional("commentary")] if preamble else []), last)


Builder = Callable[[list[TagTool], TagChoice], Node]


@dataclass(frozen=True)
class TagFamily:
    build: Builder
    # the strictness this family's parser asks for when the server leaves --tool-strict-level at auto
    default_strict_level: str | None = None


# tool parser (as vLLM names it) -> its structural tag; parsers not here constrain forced calls to JSON
FAMILIES: Final[dict[str, TagFamily]] = {
    "hermes": TagFamily(hermes),
    "qwen3_coder": TagFamily(qwen3_coder),
    "qwen3_xml": TagFamily(qwen3_coder),
    "qwen3_json": TagFamily(hermes),  # vLLM serves it with Hermes' class
    "step5": TagFamily(qwen3_coder),  # vLLM serves it with Qwen3's XML engine
    "llama3_json": TagFamily(llama),
    "llama4_json": TagFamily(llama),
    "deepseek_v31": TagFamily(deepseek_v31),
    "kimi_k2": TagFamily(kimi),
    "glm45": TagFamily(glm, default_strict_level="function"),
    "glm47": TagFamily(glm, default_strict_level="function"),
    "minimax_m2": TagFamily(minimax),
    "deepseek_v32": TagFamily(_dsml("function_calls")),
    "deepseek_v4": TagFamily(_dsml("tool_calls")),
    "openai": TagFamily(harmony),
}
