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
