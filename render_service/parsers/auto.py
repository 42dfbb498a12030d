"""``--reasoning-parser auto`` / ``--tool-call-parser auto``: the parser family read off the model bundle.

The chat template says how the model writes calls and thoughts (it teaches the markup and renders earlier calls
in it), so its markers decide first; ``config.json``'s ``model_type`` decides when the template has no telling
marker. The first family whose markers all appear wins, so the more specific families come first (Qwen3-Coder's
``<function=`` before hermes' ``<tool_call>``). A family with no reasoning (or no tool) format resolves that flag
to no parser; a model no family matches is a startup error naming the choices.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

AUTO = "auto"

logger = logging.getLogger("render_service.parsers")


class ParserFamily(msgspec.Struct, frozen=True):
    """One model family: how to recognise its bundle, and the parsers (vLLM's names) it needs."""

    name: str
    reasoning: str | None
    tool: str | None
    markers: tuple[str, ...] = ()  # every one must appear in the chat template
    model_types: tuple[str, ...] = ()  # config.json model_type values (used when no template markers match)
    # a reasoning parser only when the template also has this marker (Kimi-K2 Instruct vs Thinking, ...)
    reasoning_marker: str | None = None


DSML = "\uff5cDSML\uff5c"

# Most specific first: the first family whose markers all appear in the template is the answer.
FAMILIES: tuple[ParserFamily, ...] = (
    # DSML templates spell the marker through a variable (``<{{ dsml_token }}function_calls>``)
    ParserFamily("deepseek-v3.2", "deepseek_v4", "deepseek_v32", ("DSML", "function_calls"), ("deepseek_v32",)),
    ParserFamily("deepseek-v4", "deepseek_v4", "deepseek_v4", ("DSML",), ("deepseek_v4",)),
    ParserFamily("deepseek-v3", "deepseek_r1", "deepseek_v3", ("<\uff5ctool\u2581sep\uff5c>", "```json"),
                 reasoning_marker="<think>"),
    ParserFamily("deepseek-v3.1", "deepseek_v3", "deepseek_v31", ("<\uff5ctool\u2581calls\u2581begin\uff5c>",),
                 ("deepseek_v3",)),
    ParserFamily("kimi-k2", "kimi_k2", "kimi_k2", ("<|tool_calls_section_begin|>",), ("kimi_k2",),
                 reasoning_marker="<think>"),
    ParserFamily("kimi-k3", "kimi_k3", "kimi_k3", ("<|open|>", "<|sep|>")),
    ParserFamily("minimax-m3", "minimax_m3", "minimax_m3", ("]<]minimax[>[",)),
    ParserFamily("minimax-m2", "minimax_m2", "minimax_m2", ("<minimax:tool_call>",), ("minimax_m2",)),
    # Muse Glimmer's template teaches ATEM calls and writes to=self reasoning (Muse Spark's is not public)
    ParserFamily("muse-glimmer", "muse_glimmer", "muse_glimmer", ("<atem:function_calls>", "to=self"),
                 ("muse_glimmer",)),
    ParserFamily("seed-oss", "seed_oss", "seed_oss", ("<seed:tool_call>",), ("seed_oss",)),
    ParserFamily("plamo-3", "plamo3", "plamo3", ("plamo:begin_tool_requests",), ("plamo3",)),
    ParserFamily("step-3", "step3", "step3", ("steptml:invoke",), ("step3_vl", "step3")),
    ParserFamily("hunyuan-v3", "hy_v3", "hy_v3", ("<tool_sep>", "<arg_key>")),
    ParserFamily("glm-4.7", "glm47", "glm47", ("<tool_call>{function-name}<arg_key>",)),
    ParserFamily("glm-4.5", "glm45", "glm45", ("<arg_key>",), ("glm4_moe",)),
    ParserFamily("zaya1", "zaya", "zaya", ("<zyphra_tool_call>",), ("zaya",)),
    ParserFamily("qwen3-coder", "qwen3", "qwen3_xml", ("<function=", "<parameter="), ("qwen3_next",),
                 reasoning_marker="<think>"),
    ParserFamily("granite-4", "granite", "granite4", ("<|start_of_role|>", "<tool_call>"),
                 ("granitemoehybrid", "granite"), reasoning_marker="thought process"),
    ParserFamily("gemma-4", "gemma4", "gemma4", ("<|channel>", "<|turn>"), ("gemma4", "gemma4_text")),
    ParserFamily("functiongemma", None, "functiongemma", ("<start_function_call>",)),
    ParserFamily("cohere-command-a", "cohere_command3", "cohere_command3", ("<|START_ACTION|>",), ("cohere2",)),
    ParserFamily("apertus", None, "apertus", ("<|tools_prefix|>",), ("apertus",)),
    ParserFamily("olmo-3", "olmo3", "olmo3", ("<function_calls>",), ("olmo3",), reasoning_marker="<think>"),
    ParserFamily("internlm", None, "internlm", ("<|action_start|><|plugin|>",), ("internlm2",)),
    ParserFamily("hunyuan-a13b", "hunyuan_a13b", "hunyuan_a13b", ("<tool_calls>[", "<|extra_0|>"),
                 ("hunyuan_v1_moe",)),
    ParserFamily("jamba", None, "jamba", ("<tool_calls>[",), ("jamba",)),
    ParserFamily("phi-4-mini", None, "phi4_mini_json", ("functools[",), ("phi3",)),
    ParserFamily("lfm2", None, "lfm2", ("<|tool_call_start|>",), ("lfm2",)),
    ParserFamily("longcat", None, "longcat", ("<longcat_tool_call>",), ("longcat_flash",)),
    ParserFamily("dots", None, "dots", ("<dots_function_call>",), ("dots1",)),
    ParserFamily("ernie-4.5", "ernie45", "ernie45", ("<response>", "<tool_call>"), ("ernie4_5_moe", "ernie4_5")),
    ParserFamily("mimo", "mimo", "mimo", (), ("mimo",)),
    ParserFamily("qwen3", "qwen3", "hermes", ("<|im_start|>", "<tool_call>"), ("qwen3", "qwen3_moe", "qwen2"),
                 reasoning_marker="<think>"),
    ParserFamily("magistral", "mistral", "mistral", ("[TOOL_CALLS]",), ("mistral", "mistral3"),
                 reasoning_marker="[THINK]"),
    ParserFamily("llama-4-pythonic", None, "llama4_pythonic", ("<|header_start|>", "func_name1(")),
    ParserFamily("llama-4", None, "llama4_json", ("<|header_start|>",), ("llama4", "llama4_text")),
    ParserFamily("llama-3", None, "llama3_json", ("<|start_header_id|>", "<|python_tag|>"), ("llama",)),
)


def detect_family(chat_template: str | None, model_type: str | None) -> ParserFamily | None:
    template = chat_template or ""
    for family in FAMILIES:
        if family.markers and all(m in template for m in family.markers):
            return family
    for family in FAMILIES:
        if model_type and model_type in family.model_types:
            return family
    return None


def _choices() -> str:
    return "; ".join(f"{f.name}: --reasoning-parser {f.reasoning or '(none)'} --tool-call-parser {f.tool}"
                     for f in FAMILIES)


def resolve_auto(reasoning_parser: str | None, tool_call_parser: str | None, chat_template: str | None,
                 model_type: str | None, response_template: Any = None) -> tuple[str | None, str | None]:
    """The flags with ``auto`` replaced by the detected family's parsers (ValueError when none matches).
    ``response_template``: tokenizer_config's, where the checkpoint describes its reply; read (``hf``) only when
    no family matches, since a family's own parser knows its format better."""
    if AUTO not in (reasoning_parser, tool_call_parser):
        return reasoning_parser, tool_call_parser
    family = detect_family(chat_template, model_type)
    if family is None and isinstance(response_template, dict) and isinstance(response_template.get("fields"), dict):
        fields = response_template["fields"]
        family = ParserFamily("response-template", "hf" if "thinking" in fields else None,
                              "hf" if "tool_calls" in fields else None)
    if family is None:
        raise ValueError(
            f"--reasoning-parser/--tool-call-parser auto: no known parser family matches this model "
            f"(model_type {model_type!r}, no known markers in its chat template). Name the parsers instead; "
            f"the families: {_choices()}")
    template = chat_template or ""
    reasoning = family.reasoning
    if reasoning is not None and family.reasoning_marker is not None and template \
            and family.reasoning_marker not in template:
        reasoning = None  # the family's non-thinking models (Kimi-K2 Instruct, Qwen3-Coder, Granite 4.0)
    if reasoning_parser == AUTO:
        reasoning_parser = reasoning
    if tool_call_parser == AUTO:
        tool_call_parser = family.tool
    logger.info("parser family %s (model_type %s): --reasoning-parser %s --tool-call-parser %s", family.name,
                model_type, reasoning_parser or "(none)", tool_call_parser or "(none)")
    return reasoning_parser, tool_call_parser
