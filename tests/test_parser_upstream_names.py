"""Upstream's other names for formats we serve, and the one-line refusal of a name we do not serve."""

from __future__ import annotations

import json

import pytest

from render_service.parsers.auto import detect_family, resolve_auto
from render_service.parsers.base import ReasoningParserConfig
from render_service.parsers.registry import UnknownParserError, get_reasoning_parser, get_tool_parser
from tests.family_bundles import TEMPLATES
from tests.test_tool_parsers_common import Folded, parse, split_reasoning
from tests.tool_parser_invariants import write_glm, write_hermes, write_longcat, write_qwen3_xml

CALLS = [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("alias,same_as,write", [
    ("qwen3_json", "hermes", write_hermes), ("step5", "qwen3_xml", write_qwen3_xml),
    ("ernie45", "hermes", write_hermes), ("poolside_v1", "glm45", write_glm), ("ling3", "glm47", write_glm),
    ("granite_toolcall_parser", "qwen3_xml", write_qwen3_xml)])
def test_tool_alias_parses_as_its_format(alias, same_as, write) -> None:
    text = "Sure.\n" + write(CALLS) + "\nDone."
    folded = parse(alias, text)
    assert folded == parse(same_as, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == CALLS


def test_longcat_reads_hermes_calls_in_its_own_tags() -> None:
    text = "Sure.\n" + write_longcat(CALLS) + "\nDone."
    folded = parse("longcat", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == CALLS
    assert folded.content == "Sure.\nDone."
    # hermes' own tags are not longcat's: text
    assert parse("longcat", write_hermes(CALLS)).calls == []


def _split(name: str, text: str, kwargs: dict | None = None) -> list[tuple[str, str]]:
    cls = get_reasoning_parser(name)
    return split_reasoning(cls(ReasoningParserConfig(enable_thinking=cls.enable_thinking_from(kwargs))), text)


@pytest.mark.parametrize("name,text,kwargs,expected", [
    ("step5", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("holo2", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("holo2", "answer", {"thinking": False}, [("content", "answer")]),
    ("minimax_m3", "plan</mm:think>answer", {"thinking_mode": "enabled"}, [("reasoning", "plan"), ("content", "answer")]),
    ("minimax_m3", "answer", None, [("content", "answer")]),
    ("minimax_m3", "<mm:think>plan</mm:think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("ernie45", "plan\n</think>\n\n<response>\nanswer\n</response>\n",
     None, [("reasoning", "plan\n"), ("content", "\n\n\nanswer\n\n")]),
    ("ernie45", "plan</think>answer <resp", None, [("reasoning", "plan"), ("content", "answer <resp")]),
    ("hunyuan_a13b", "<think>\nplan\n</think>\n<answer>\nanswer\n</answer>",
     None, [("reasoning", "\nplan\n"), ("content", "\n\nanswer\n")]),
    ("poolside_v1", "answer", None, [("content", "answer")]),
    ("poolside_v1", "plan</think>answer", {"thinking": True}, [("reasoning", "plan"), ("content", "answer")]),
    ("step3", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("hy_v3", "<think>plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("hy_v3", "answer", {"reasoning_effort": "no_think"}, [("content", "answer")]),
    ("ling3", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("ling3", "answer", {"enable_thinking": False}, [("content", "answer")]),
    ("mimo", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("nemotron_v3", "<think>plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("olmo3", "<think>plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("step3p5", "plan</think>answer", {"enable_thinking": False}, [("reasoning", "plan"), ("content", "answer")]),
    ("deepseek_v41", "plan<\uff5cDSML\uff5c calls>x", {"thinking": True},
     [("reasoning", "plan"), ("content", "<\uff5cDSML\uff5c calls>x")]),
    ("plamo3", "plan<|plamo:end_think:plamo|>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("gemma4", "<|channel>thought\nplan<channel|>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("gemma4", "<|channel>thought\nplan<channel|>answer", {"enable_thinking": True},
     [("reasoning", "plan"), ("content", "answer")]),
    ("gemma4", "thought\nplan<channel|>answer", {"enable_thinking": True},
     [("reasoning", "plan"), ("content", "answer")]),
    ("gemma4", "thought\nanswer", None, [("content", "answer")]),
    ("granite_thinking_parser", "plan\n</think>\n\nanswer\n", None, [("reasoning", "plan\n"), ("content", "answer\n")]),
    ("granite_thinking_parser", "\n\nanswer", {"enable_thinking": False}, [("content", "answer")]),
    ("gemma4", "answer <|channel>", None, [("content", "answer <|channel>")]),
    ("kimi_k3", "plan<|close|>think<|sep|><|open|>response<|sep|>answer", None,
     [("reasoning", "plan"), ("content", "<|open|>response<|sep|>answer")]),
    ("kimi_k3", "<|open|>think<|sep|>plan<|close|>think<|sep|>answer", {"thinking": True},
     [("reasoning", "plan"), ("content", "answer")]),
    ("kimi_k3", "answer", {"thinking": False}, [("content", "answer")]),
    ("k2_horizon", "plan</ifm|think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("k2_horizon", "<ifm|think>plan<ifm|tool_calls>x", None,
     [("reasoning", "plan"), ("content", "<ifm|tool_calls>x")]),
    ("minicpmv", "answer", None, [("content", "answer")]),
    ("minicpmv", "<think>plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("minicpmv", "plan</think>answer", {"enable_thinking": True}, [("reasoning", "plan"), ("content", "answer")]),
    ("inkling", "<|content_thinking|>plan<|end_message|><|message_model|><|content_text|>answer", None,
     [("reasoning", "plan"), ("content", "<|message_model|><|content_text|>answer")]),
    ("inkling", "<|message_model|><|content_thinking|>plan<|content_invoke_tool_json|>{}", None,
     [("reasoning", "plan"), ("content", "<|content_invoke_tool_json|>{}")]),
    ("inkling", "<|message_model|><|content_text|>answer", None,
     [("content", "<|message_model|><|content_text|>answer")]),
    ("hy_v4", "plan</think>answer", None, [("reasoning", "plan"), ("content", "answer")]),
    ("hy_v4", "answer", {"reasoning_effort": "no_think"}, [("content", "answer")]),
    ("kimi_k3", "answer", {"enable_thinking": False}, [("content", "answer")]),
    ("gemma4", "<|channel>plan<|tool_call>call", {"enable_thinking": True},
     [("reasoning", "plan"), ("content", "<|tool_call>call")]),
])
def test_reasoning_names(name, text, kwargs, expected) -> None:
    assert _split(name, text, kwargs) == expected


# Every name vLLM 0.34 registers (vllm/tool_parsers/__init__.py and vllm/reasoning/__init__.py of its wheel).
VLLM_034_TOOL_PARSERS = [
    "apertus", "beam", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47",
    "granite", "granite-20b-fc", "granite4", "granite_toolcall_parser", "hermes", "hf", "hunyuan_a13b", "hy_v3",
    "hy_v4", "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse",
    "muse_glimmer", "musespark", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic",
    "qwen3_coder", "qwen3_json", "qwen3_xml", "ripple", "seed_oss", "step3", "step3p5", "step5", "xlam", "zaya",
    "zaya_xml",
]
VLLM_034_REASONING_PARSERS = [
    "beam", "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41",
    "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b",
    "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse", "muse_glimmer", "musespark", "nemotron_v3", "olmo3",
    "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "ripple", "seed_oss", "step3", "step3p5", "step5", "zaya",
]


def test_every_name_vllm_034_registers_is_served() -> None:
    assert len(VLLM_034_TOOL_PARSERS) == 62 and len(VLLM_034_REASONING_PARSERS) == 44
    for name in VLLM_034_TOOL_PARSERS:
        assert get_tool_parser(name) is not None, name
    for name in VLLM_034_REASONING_PARSERS:
        assert get_reasoning_parser(name) is not None, name


@pytest.mark.parametrize("lookup", [get_tool_parser, get_reasoning_parser])
def test_a_name_we_do_not_serve_is_refused_in_one_line(lookup) -> None:
    with pytest.raises(UnknownParserError) as err:
        lookup("gemma4_not_served")
    assert "\n" not in str(err.value) and "gemma4_not_served" in str(err.value)


def test_kimi_k3_reads_xtml_calls_and_drops_the_response_channel() -> None:
    text = ('<|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>\n'
            '<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|> New York <|close|>argument<|sep|>'
            '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
            '<|open|>argument key="note"<|sep|>3<|close|>argument<|sep|>'
            '<|close|>call<|sep|>\n<|close|>tools<|sep|>')
    folded = parse("kimi_k3", text)
    assert parse_chunks_equal("kimi_k3", text)
    # a string value keeps its spaces; no type reads as a string (upstream's default)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": " New York ", "days": 3, "note": "3"})]
    assert folded.content == "On it."  # whitespace after the tools channel is layout


def test_auto_reads_kimi_k3_off_its_xtml_markers() -> None:
    # no Kimi K3 template is in the public sources we can read: a template writing XTML elements stands in
    source = "{{- '<|open|>message role=\"' + m.role + '\"<|sep|>' + m.content + '<|close|>message<|sep|>' }}"
    assert resolve_auto("auto", "auto", source, None) == ("kimi_k3", "kimi_k3")


def test_hy_v4_reads_glm_like_calls_without_a_separator() -> None:
    text = ("Ok.<tool_calls><tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>x</arg_key><arg_value>[1]</arg_value></tool_call>"
            "<tool_call>get_time</tool_call></tool_calls>")
    folded = parse("hy_v4", text)
    assert parse_chunks_equal("hy_v4", text)
    # days is typed by the schema; x is not declared: a string (upstream's fallback type)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "x": "[1]"}), ("get_time", {})]
    assert folded.content == "Ok."


def test_apertus_reads_calls_keyed_by_their_name() -> None:
    text = ('I will check. <|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, {"get_time": {}}]'
            "<|tools_suffix|> Done")
    folded = parse("apertus", text)
    assert parse_chunks_equal("apertus", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    assert folded.content == "I will check.  Done"
    # arguments that are not an object: the call gets {} and the text is content
    assert parse("apertus", '<|tools_prefix|>[{"get_time": 3}]<|tools_suffix|>') == Folded(
        content="3", calls=[{"name": "get_time", "arguments": "{}", "id": None}])
    # vLLM's Apertus tool template sets the markers as variables
    assert resolve_auto("auto", "auto", "{%- set tool_calls_token = '<|tools_prefix|>' -%}", None) == (None, "apertus")


def test_k2_horizon_reads_ifm_xml_calls_typed_by_the_schema() -> None:
    text = ("Ok.<ifm|tool_calls><ifm|tool_call>get_weather<ifm|arg_key>city</ifm|arg_key><ifm|arg_value> Paris "
            "</ifm|arg_value><ifm|arg_key>days</ifm|arg_key><ifm|arg_value>3</ifm|arg_value><ifm|arg_key>x</ifm|arg_key>"
            "<ifm|arg_value>[1]</ifm|arg_value></ifm|tool_call><ifm|tool_call>get_time</ifm|tool_call></ifm|tool_calls>")
    folded = parse("k2_horizon", text)
    assert parse_chunks_equal("k2_horizon", text)
    # a string keeps its spaces (upstream: raw for string types); undeclared values stay strings
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": " Paris ", "days": 3, "x": "[1]"}), ("get_time", {})]


def test_minicpm5_reads_bare_function_blocks() -> None:
    text = ('Sure.<function name="get_weather"><param name="city"> Paris </param><param name="days">3</param>'
            '<param name="x">[1]</param></function>\n<function name="get_time"></function>')
    folded = parse("minicpm5", text)
    assert parse_chunks_equal("minicpm5", text)
    # values are stripped (upstream); x is not declared: read as a literal
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "x": [1]}), ("get_time", {})]
    assert folded.content == "Sure."


def test_zaya_xml_reads_qwen3_calls_in_zyphra_tags() -> None:
    text = "Sure.\n" + write_qwen3_xml(CALLS).replace("tool_call>", "zyphra_tool_call>") + "\nDone."
    folded = parse("zaya_xml", text)
    assert parse_chunks_equal("zaya_xml", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == CALLS
    assert folded.content == "Sure.\nDone."
    assert parse("zaya_xml", "<tool_call>x</tool_call>").content == "<tool_call>x</tool_call>"  # not its block


def test_inkling_reads_call_blocks_and_drops_block_markers() -> None:
    text = ('<|message_model|><|content_text|>Checking.<|end_message|><|message_model|><|content_invoke_tool_json|>'
            '{"name": "get_weather", "args": {"city": "SF"}}<|end_message|><|message_model|>'
            '<|content_invoke_tool_json|>{"name": "get_time", "args": {}}<|end_message|>')
    folded = parse("inkling", text)
    assert parse_chunks_equal("inkling", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "SF"}), ("get_time", {})]
    assert folded.content == "Checking."


@pytest.mark.parametrize("name, text", [
    ("minicpm5", '<function name=x "get_weather"><param name=c "city">1</param></function>'),
    ("dots", '<dots_function_call>\n<invoke name=x "get_weather">\n</invoke>\n</dots_function_call>'),
])
def test_a_word_beside_a_quoted_name_that_is_no_attribute_is_content(name, text) -> None:
    # found by the invariants' soup on minicpm5: the XML engine took `"get_weather"` after the name for an
    # attribute and dropped it; attributes (key="value") stay markup
    folded = parse(name, text)
    assert parse_chunks_equal(name, text)
    assert folded.calls[0]["name"] == "x"
    assert "get_weather" in (folded.content or "")


def test_mimo_values_keep_every_character_and_are_typed() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>3</parameter>\n" \
           "</function>\n</tool_call>"
    folded = parse("mimo", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("get_weather", {"city": "\nParis\n", "days": 3})]


@pytest.mark.parametrize("template, model_type, family, expected", [
    ("internlm2-tool.jinja", None, "internlm", (None, "internlm")),
    ("phi-4-mini.jinja", None, "phi-4-mini", (None, "phi4_mini_json")),
    ("hunyuan-a13b.jinja", None, "hunyuan-a13b", ("hunyuan_a13b", "hunyuan_a13b")),
    (None, "jamba", "jamba", (None, "jamba")),
    (None, "lfm2", "lfm2", (None, "lfm2")),
    (None, "mimo", "mimo", ("mimo", "mimo")),
    (None, "plamo3", "plamo-3", ("plamo3", "plamo3")),
    (None, "step3", "step-3", ("step3", "step3")),
    (None, "longcat_flash", "longcat", (None, "longcat")),
    (None, "dots1", "dots", (None, "dots")),
    (None, "ernie4_5_moe", "ernie-4.5", ("ernie45", "ernie45")),
    (None, "gemma4", "gemma-4", ("gemma4", "gemma4")),
])
def test_auto_detects_the_new_families(template, model_type, family, expected) -> None:
    source = (TEMPLATES / template).read_text(encoding="utf-8") if template else None
    assert detect_family(source, model_type).name == family
    assert resolve_auto("auto", "auto", source, model_type) == expected


@pytest.mark.parametrize("template", ["kimi-k2-thinking.jinja", "llama-4.jinja", "glm-4.6.jinja", "glm-4.7-flash.jinja",
                                      "minimax-m2.jinja", "seed-oss.jinja", "qwen3-coder.jinja", "granite-4.0.jinja"])
def test_the_new_families_do_not_claim_the_old_templates(template) -> None:
    family = detect_family((TEMPLATES / template).read_text(encoding="utf-8"), None)
    assert family is not None and family.tool not in {
        "internlm", "phi4_mini_json", "hunyuan_a13b", "jamba", "lfm2", "longcat", "dots", "ernie45", "plamo3",
        "step3", "hy_v3", "deepseek_v3", "gemma4", "functiongemma", "kimi_k3", "olmo3", "apertus",
        "cohere_command3", "minimax_m3"}


@pytest.mark.parametrize("marker", ["<|tool_call|>", "<tool_call>"])
def test_granite_reads_a_json_list_after_its_marker(marker: str) -> None:
    text = f'Sure. {marker} [{{"name": "get_weather", "arguments": {{"city": "SF"}}}}] Done.'
    folded = parse("granite", text)
    assert parse_chunks_equal("granite", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [("get_weather", {"city": "SF"})]
    assert folded.content == "Sure.  Done."


def parse_chunks_equal(name: str, text: str) -> bool:
    from tests.test_tool_parsers_common import parse_chunks

    return parse_chunks(name, list(text)) == parse(name, text)
