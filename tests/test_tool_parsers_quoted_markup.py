"""Markup the model quotes is not markup: extra XML attributes, a literal end tag or a quoted call inside a
string value, a call quoted while thinking. Each case streams as it parses whole."""

from __future__ import annotations

import json

import pytest

from tests.test_tool_parsers_common import assert_split_invariant, parse


def _calls(folded) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in folded.calls]


def test_minimax_extra_attributes_are_not_part_of_names_or_keys() -> None:
    text = ('<minimax:tool_call>\n<invoke name="run" description="Run a command">\n'
            '<parameter name="code" type="string">ls -l</parameter>\n</invoke>\n</minimax:tool_call>')
    folded = assert_split_invariant("minimax_m2", text, range(0, len(text), 7))
    assert _calls(folded) == [("run", {"code": "ls -l"})]
    assert folded.content is None


@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen3_xml"])
def test_literal_end_tag_then_call_end_inside_a_value_stays_in_it(parser: str) -> None:
    value = "x</parameter></function> not the end"
    text = f"<tool_call>\n<function=write_file>\n<parameter=content>\n{value}\n</parameter>\n</function>\n</tool_call>"
    folded = assert_split_invariant(parser, text, range(0, len(text), 3))
    assert _calls(folded) == [("write_file", {"content": value})]
    assert folded.content is None


@pytest.mark.parametrize("parser", ["qwen3_coder", "qwen3_xml"])
def test_a_quoted_call_repeating_a_key_stays_in_the_value(parser: str) -> None:
    quoted = "Example:\n</parameter>\n<parameter=path>\nb.md"
    text = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.md\n</parameter>\n"
            f"<parameter=content>\n{quoted}\n</parameter>\n</function>\n</tool_call>")
    folded = assert_split_invariant(parser, text, range(0, len(text), 5))
    assert _calls(folded) == [("write_file", {"path": "a.md", "content": quoted})]
    # no duplicate key in what streamed: the raw arguments hold "path" once
    assert folded.calls[0]["arguments"].count('"path"') == 1


def test_qwen3_new_key_after_end_tag_still_ends_the_value() -> None:
    text = ("<tool_call>\n<function=write_file>\n<parameter=content>\nx\n</parameter>\n"
            "<parameter=path>\ny\n</parameter>\n</function>\n</tool_call>")
    assert _calls(parse("qwen3_coder", text)) == [("write_file", {"content": "x", "path": "y"})]


def test_seed_oss_call_quoted_while_thinking_is_content() -> None:
    thought = ("<seed:think>I could call <seed:tool_call>\n<function=get_time>\n</function>\n"
               "</seed:tool_call> here</seed:think>\n")
    call = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</seed:tool_call>"
    folded = assert_split_invariant("seed_oss", thought + call, range(0, len(thought + call), 4))
    assert _calls(folded) == [("get_weather", {"city": "Paris"})]
    assert folded.content == thought


@pytest.mark.parametrize("text,expected", [
    ("<think>plan<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">",
     [("reasoning", "plan"), ("content", "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">")]),
    ("<think>plan</think>ok", [("reasoning", "plan"), ("content", "ok")]),
    ("plain <think>x", [("content", "plain <think>x")]),
])
def test_deepseek_v4_chat_mode_explicit_think_opens_reasoning(text: str, expected: list) -> None:
    from render_service.parsers.base import ReasoningParserConfig
    from render_service.parsers.registry import get_reasoning_parser

    parser = get_reasoning_parser("deepseek_v4")(ReasoningParserConfig(enable_thinking=False))
    for cuts in ([text], list(text)):
        state = parser.initial_state()
        pieces = [p for chunk in cuts for p in parser.feed(state, chunk)] + parser.finish(state)
        merged: list[list[str]] = []
        for p in pieces:
            if merged and merged[-1][0] == p.channel:
                merged[-1][1] += p.text
            else:
                merged.append([p.channel, p.text])
        assert [tuple(m) for m in merged] == expected


@pytest.mark.parametrize("written,expected", [
    ("\"{'a': 1, 'b': True}\"", {"a": 1, "b": True}),  # a Python repr inside a JSON string
    ('"{\\"a\\": 1}"', {"a": 1}),  # JSON inside a JSON string
    ("{'a': None}", {"a": None}),  # a Python repr
])
def test_object_parameter_written_as_a_string_holding_a_value(written: str, expected: dict) -> None:
    from render_service.parsers.base import ToolParserConfig, ToolSpec

    tools = ToolParserConfig(tools=[ToolSpec(name="configure", parameters={
        "type": "object", "properties": {"options": {"type": "object"}}})])
    text = f"<tool_call>\n<function=configure>\n<parameter=options>\n{written}\n</parameter>\n</function>\n</tool_call>"
    folded = parse("qwen3_coder", text, tools)
    assert _calls(folded) == [("configure", {"options": expected})]


KIMI_BARE = ('<|tool_calls_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>{ARGS}'
             '<|tool_call_end|><|tool_calls_section_end|>')


@pytest.mark.parametrize("args,expected", [
    ('{"city": "Paris", "days": 2}', [("get_weather", {"city": "Paris", "days": 2})]),
    ('{"path": "a.txt", "content": "x"}', [("write_file", {"path": "a.txt", "content": "x"})]),
])
def test_kimi_bare_call_id_is_named_by_its_argument_keys(args: str, expected: list) -> None:
    text = "Checking. " + KIMI_BARE.replace("{ARGS}", args)
    folded = assert_split_invariant("kimi_k2", text, range(0, len(text), 3))
    assert _calls(folded) == expected
    assert folded.calls[0]["id"] == "0"  # the model's own id text: a later turn renders the call as generated
    assert folded.content == "Checking. "


@pytest.mark.parametrize("args", ['{"text": "hi", "code": "x"}', '{}', '{"city": "Par'])
def test_kimi_bare_call_id_its_arguments_do_not_name_is_content(args: str) -> None:
    text = KIMI_BARE.replace("{ARGS}", args)
    if args.endswith("Par"):
        text = text.split("<|tool_call_end|>")[0]  # cut off
    folded = assert_split_invariant("kimi_k2", text, range(0, len(text), 4))
    assert folded.calls == []
    assert "0<|tool_call_argument_begin|>" + args in (folded.content or "")


def test_deepseek_v4_chat_mode_from_the_prompt_through_the_pipeline() -> None:
    """The prompt's closing </think> (chat mode) travels in the stream's state: one parser serves every stream."""
    import tempfile
    from pathlib import Path

    from render_service.bundle.model_bundle import load_bundle
    from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
    from tests.family_bundles import write_family_bundle

    with tempfile.TemporaryDirectory() as tmp:
        tok = load_bundle(write_family_bundle("deepseek_v4", Path(tmp) / "b")).tokenizer
    config = PipelineConfig(request_id="r", reasoning_parser="deepseek_v4", skip_special_tokens=False)
    prompt = tok.encode("<｜User｜>hi<｜Assistant｜></think>")
    for text, reasoning, content in [("<think>plan</think>answer", "plan", "answer"), ("answer", None, "answer")]:
        message, _ = derender_all(Pipeline(tok, config), tok.encode(text), prompt)
        assert (message["reasoning"], message["content"]) == (reasoning, content)
