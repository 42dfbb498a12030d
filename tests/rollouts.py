"""Agent rollouts a model could really sample but a template re-renders differently, per model family: the
sampled turn's text in the family's own format (Python-style booleans in arguments, odd JSON spacing and key
order, reasoning the template drops later, outputs cut short by ``length``) and the message a client parses it
into. Shared by the extend tests and bench/extend_bench.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from render_service.bundle.model_bundle import load_bundle
from render_service.render.render_config import RenderConfig, build_render_config
from tests import family_bundles

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the files.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "exact": {"type": "boolean"},
                                                    "limit": {"type": "integer"}}, "required": ["q"]}}}]


@dataclass(frozen=True)
class Family:
    """How a family's model writes a tool call and ends its turn (``end``: its end-of-turn marker)."""

    name: str
    end: str
    call: str  # format with {args} (the raw JSON text) and {name}
    think: tuple[str, str] = ("<think>\n", "\n</think>\n\n")


# The sampled tool-call text per family; {args} is the arguments as the model wrote them.
FAMILIES = {
    "qwen3": Family("qwen3", "<|im_end|>", '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'),
    "qwen3_xml": Family("qwen3_xml", "<|im_end|>",
                        "<tool_call>\n<function={name}>\n<parameter=q>\ncats\n</parameter>\n</function>\n</tool_call>"),
    "glm45": Family("glm45", "<|observation|>", "<tool_call>{name}\n<arg_key>q</arg_key>\n<arg_value>cats</arg_value>\n"
                    "</tool_call>", ("<think>", "</think>")),
    "glm47": Family("glm47", "<|observation|>", "<tool_call>{name}<arg_key>q</arg_key><arg_value>cats</arg_value>"
                    "</tool_call>", ("<think>", "</think>")),
    "kimi_k2": Family("kimi_k2", "<|im_end|>", "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
                      "<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>",
                      ("<think>", "</think>")),
    "minimax_m2": Family("minimax_m2", "[e~[", '<minimax:tool_call>\n<invoke name="{name}">\n<parameter name="q">'
                         "cats</parameter>\n</invoke>\n</minimax:tool_call>", ("<think>\n", "\n</think>\n\n")),
    "seed_oss": Family("seed_oss", "<seed:eos>", "<seed:tool_call>\n<function={name}>\n<parameter=q>cats</parameter>\n"
                       "</function>\n</seed:tool_call>", ("<seed:think>", "</seed:think>")),
    "deepseek_v4": Family("deepseek_v4", "<｜end▁of▁sentence｜>",
                          "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"{name}\">\n<｜DSML｜parameter name=\"q\" "
                          "string=\"true\">cats</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                          ("", "</think>")),
    "llama4": Family("llama4", "<|eot|>", '{{"name": "{name}", "parameters": {args}}}', ("", "")),
    "granite4": Family("granite4", "<|end_of_text|>", '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n'
                       "</tool_call>", ("", "")),
    "magistral": Family("magistral", "</s>", "[TOOL_CALLS]{name}[ARGS]{args}", ("[THINK]", "[/THINK]")),
}

# Arguments as a model may write them: Python booleans, odd spacing, keys out of the schema's order.
ODD_ARGUMENTS = ['{"exact": False,  "q": "cats"}', '{ "q":"cats","limit" :3 }', '{"q": "cats", "exact": True}',
                 '{"limit": 10, "q": "cats dogs"}']
PARSED_ARGUMENTS = [{"q": "cats", "exact": False}, {"q": "cats", "limit": 3}, {"q": "cats", "exact": True},
                    {"q": "cats dogs", "limit": 10}]


def family_config(family: str, root: Path) -> RenderConfig:
    if family == "qwen3":
        from tests.render_harness import qwen3_bundle

        return build_render_config(qwen3_bundle(), served_model_names=["m"])
    bundle = load_bundle(str(family_bundles.write_family_bundle(family, root / family)))
    return build_render_config(bundle, served_model_names=["m"])


def tool_turn(family: Family, variant: int, reasoning: str | None = "Let me search.",
              truncated: bool = False, call_id: str = "call_1") -> tuple[str, dict[str, Any]]:
    """(the text the model sampled, the assistant message a client parses from it)."""
    args = ODD_ARGUMENTS[variant % len(ODD_ARGUMENTS)]
    parsed = PARSED_ARGUMENTS[variant % len(PARSED_ARGUMENTS)]
    body = family.call.format(name="search", args=args)
    text = (family.think[0] + reasoning + family.think[1] if reasoning and family.think[1] else "") + body
    if not truncated:
        text += family.end
    else:  # cut by max_tokens: the call never closed
        text = text[: len(text) - 7]
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "search", "arguments": json.dumps(parsed)}}]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return text, message


def answer_turn(family: Family, answer: str, reasoning: str | None = "Done.") -> tuple[str, dict[str, Any]]:
    text = (family.think[0] + reasoning + family.think[1] if reasoning and family.think[1] else "") + answer
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning_content"] = reasoning
    return text + family.end, message


def tool_result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": "search", "content": text}
