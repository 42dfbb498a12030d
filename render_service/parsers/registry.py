"""Parser lookup by the names vLLM's flags use (``--reasoning-parser``, ``--tool-call-parser``).

Tool parser families are imported on first use, so a server loads only the parser it runs.
"""

from __future__ import annotations

import importlib

from render_service.parsers.base import ToolParser
from render_service.parsers.harmony import HarmonyParser
from render_service.parsers.muse_channels import MUSE_REASONING_PARSERS
from render_service.parsers.reasoning import REASONING_PARSERS as _CORE_REASONING_PARSERS
from render_service.parsers.reasoning import ThinkReasoningParser
from render_service.parsers.reasoning_families import FAMILY_REASONING_PARSERS, MORE_REASONING_PARSERS
from render_service.parsers.reasoning_granite import GraniteReasoningParser
from render_service.parsers.reasoning_mistral import MistralReasoningParser
from render_service.parsers.response_template import BeamReasoningParser, ResponseTemplateReasoningParser

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    **_CORE_REASONING_PARSERS, **FAMILY_REASONING_PARSERS, **MORE_REASONING_PARSERS,
    MistralReasoningParser.name: MistralReasoningParser, GraniteReasoningParser.name: GraniteReasoningParser,
    # read by the bundle's response_template: bound to it where a tokenizer is known (bind_parser)
    ResponseTemplateReasoningParser.name: ResponseTemplateReasoningParser,
    BeamReasoningParser.name: BeamReasoningParser,
    **MUSE_REASONING_PARSERS,
}

# name -> (module, class), the names as vLLM's ``--tool-call-parser`` spells them
_TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("render_service.parsers.tools_hermes", "HermesToolParser"),
    "qwen3_coder": ("render_service.parsers.tools_qwen3_coder", "Qwen3CoderToolParser"),
    "qwen3_xml": ("render_service.parsers.tools_qwen3_xml", "Qwen3XmlToolParser"),
    "llama3_json": ("render_service.parsers.tools_json", "Llama3JsonToolParser"),
    "mistral": ("render_service.parsers.tools_mistral", "MistralToolParser"),
    "deepseek_v31": ("render_service.parsers.tools_deepseek", "DeepSeekV31ToolParser"),
    "pythonic": ("render_service.parsers.tools_pythonic", "PythonicToolParser"),
    "kimi_k2": ("render_service.parsers.tools_kimi", "KimiK2ToolParser"),
    "glm45": ("render_service.parsers.tools_glm", "Glm45ToolParser"),
    "glm47": ("render_service.parsers.tools_glm", "Glm47ToolParser"),
    "minimax_m2": ("render_service.parsers.tools_minimax", "MiniMaxM2ToolParser"),
    "seed_oss": ("render_service.parsers.tools_seed_oss", "SeedOssToolParser"),
    "deepseek_v32": ("render_service.parsers.tools_dsml", "DeepSeekV32ToolParser"),
    "deepseek_v4": ("render_service.parsers.tools_dsml", "DeepSeekV4ToolParser"),
    "llama4_json": ("render_service.parsers.tools_json", "Llama3JsonToolParser"),  # one class upstream too
    "llama4_pythonic": ("render_service.parsers.tools_llama4_pythonic", "Llama4PythonicToolParser"),
    "granite4": ("render_service.parsers.tools_granite4", "Granite4ToolParser"),
    "openai": ("render_service.parsers.harmony", "HarmonyToolCalls"),  # gpt-oss; parsed by the Harmony stage
    # upstream's other names for these formats
    "qwen3_json": ("render_service.parsers.tools_hermes", "Qwen3JsonToolParser"),  # vLLM: Hermes' class
    "step5": ("render_service.parsers.tools_qwen3_xml", "Step5ToolParser"),  # vLLM: Qwen3's XML engine
    "longcat": ("render_service.parsers.tools_hermes", "LongcatToolParser"),
    "ernie45": ("render_service.parsers.tools_hermes", "Ernie45ToolParser"),
    "poolside_v1": ("render_service.parsers.tools_xml_families", "PoolsideV1ToolParser"),
    "deepseek_v3": ("render_service.parsers.tools_deepseek", "DeepSeekV3ToolParser"),
    "ling3": ("render_service.parsers.tools_glm", "Ling3ToolParser"),
    "mimo": ("render_service.parsers.tools_qwen3_xml", "MiMoToolParser"),
    "step3p5": ("render_service.parsers.tools_qwen3_xml", "Step3p5ToolParser"),
    "deepseek_v41": ("render_service.parsers.tools_dsml", "DeepSeekV41ToolParser"),
    "plamo3": ("render_service.parsers.tools_deepseek", "Plamo3ToolParser"),
    "hunyuan_a13b": ("render_service.parsers.tools_wrapped_families", "HunyuanA13BToolParser"),
    "dots": ("render_service.parsers.tools_xml_families", "DotsToolParser"),
    "hy_v3": ("render_service.parsers.tools_xml_families", "HyV3ToolParser"),
    "step3": ("render_service.parsers.tools_xml_families", "Step3ToolParser"),
    "granite-20b-fc": ("render_service.parsers.tools_wrapped_families", "Granite20bFCToolParser"),
    "gigachat3": ("render_service.parsers.tools_wrapped_families", "GigaChat3ToolParser"),
    "xlam": ("render_service.parsers.tools_json", "XLamToolParser"),
    "granite": ("render_service.parsers.tools_wrapped_families", "GraniteToolParser"),
    "granite_toolcall_parser": ("render_service.parsers.tools_qwen3_xml", "GraniteToolCallToolParser"),
    "lfm2": ("render_service.parsers.tools_wrapped_families", "Lfm2ToolParser"),
    "jamba": ("render_service.parsers.tools_wrapped_families", "JambaToolParser"),
    "phi4_mini_json": ("render_service.parsers.tools_wrapped_families", "Phi4MiniJsonToolParser"),
    "internlm": ("render_service.parsers.tools_wrapped_families", "InternLMToolParser"),
    "cohere_command3": ("render_service.parsers.tools_wrapped_families", "CohereCommand3ToolParser"),
    "cohere_command4": ("render_service.parsers.tools_wrapped_families", "CohereCommand4ToolParser"),
    "minimax_m3": ("render_service.parsers.tools_minimax_m3", "MiniMaxM3ToolParser"),
    "inkling": ("render_service.parsers.tools_wrapped_families", "InklingToolParser"),
    "zaya_xml": ("render_service.parsers.tools_qwen3_xml", "ZayaXmlToolParser"),
    "minicpm5": ("render_service.parsers.tools_xml_families", "MiniCPM5ToolParser"),
    "k2_horizon": ("render_service.parsers.tools_xml_families", "K2HorizonToolParser"),
    "apertus": ("render_service.parsers.tools_wrapped_families", "ApertusToolParser"),
    "hy_v4": ("render_service.parsers.tools_xml_families", "HyV4ToolParser"),
    "olmo3": ("render_service.parsers.tools_wrapped_families", "Olmo3ToolParser"),
    "kimi_k3": ("render_service.parsers.tools_xml_families", "KimiK3ToolParser"),
    "gemma4": ("render_service.parsers.tools_gemma", "Gemma4ToolParser"),
    "functiongemma": ("render_service.parsers.tools_gemma", "FunctionGemmaToolParser"),
    "zaya": ("render_service.parsers.tools_qwen3_xml", "ZayaToolParser"),
    "ripple": ("render_service.parsers.tools_hermes", "RippleToolParser"),
    "hf": ("render_service.parsers.response_template", "ResponseTemplateToolParser"),
    "beam": ("render_service.parsers.response_template", "BeamToolParser"),
    "muse": ("render_service.parsers.tools_muse", "MuseToolParser"),
    "muse_glimmer": ("render_service.parsers.tools_muse", "MuseGlimmerToolParser"),
    "musespark": ("render_service.parsers.tools_muse", "MuseSparkToolParser"),  # upstream's alias of muse
}


class UnknownParserError(KeyError, ValueError):
    """An unknown parser name. A ValueError for configuration checks, a KeyError for lookups."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under ``name``; UnknownParserError (listing the known names) if none."""
    try:
        module, cls = _TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(tool_parser_names())
        raise UnknownParserError(f"unknown tool call parser {name!r}; known: {known}") from None
    parser: type[ToolParser] = getattr(importlib.import_module(module), cls)
    return parser


def get_reasoning_parser(name: str) -> type[ThinkReasoningParser] | type[HarmonyParser]:
    if name == "openai_gptoss":  # gpt-oss's Harmony stage (reasoning and tool calls in one)
        return HarmonyParser
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted([*REASONING_PARSERS, "openai_gptoss"]))
        raise UnknownParserError(f"unknown reasoning parser {name!r}; known: {known}") from None
