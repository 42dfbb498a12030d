"""Forced tool choice ("required", named) in the model's own call syntax: render constrains the output to vLLM's
structural tag for the family (tests/test_tool_constraint_parity.py holds the tag to vLLM's bytes); derender reads
the whole call with the family's parser, and still reads a call an earlier render of ours opened in the prompt.

Real components: our render and derender functions, Qwen3's real tokenizer with Qwen3-Coder's real template
(qwen3_xml) and GLM-4.7's real template with the GLM test tokenizer (tests/family_bundles.py).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.derender.batch import pipeline_config
from render_service.parsers.pipeline import MessageAccumulator, Pipeline, derender_all
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import TEMPLATES, write_family_bundle
from tests.shared_paths import QWEN3_FIXTURE_DIR

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(tool_choice, **extra) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                            "tools": [WEATHER, TIME], "tool_choice": tool_choice, **extra}, ChatCompletionRequest)


@pytest.fixture(scope="module")
def qwen3_xml_config():
    bundle = load_bundle(QWEN3_FIXTURE_DIR)
    return build_render_config(bundle, served_model_names=["m"], reasoning_parser="qwen3", tool_call_parser="qwen3_xml",
                               chat_template=(TEMPLATES / "qwen3-coder.jinja").read_text(encoding="utf-8"))


def derender(config, req, gen, output: str, one_token: bool = False) -> dict:
    pcfg = pipeline_config(config, req, request_id=gen.request_id, choice_index=0)
    pipeline = Pipeline(config.tokenizer, pcfg)
    ids = config.tokenizer.encode(output)
    if not one_token:
        return derender_all(pipeline, ids, prompt_token_ids=gen.token_ids,
                            reasoning_open_at_start=None if gen.reasoning_ended is None else not gen.reasoning_ended)[0]
    state = pipeline.initial_state(gen.token_ids)
    acc = MessageAccumulator()
    for t in ids:
        state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
        acc.add(pipeline.feed(state, [t]))
    acc.add(pipeline.finish(state))
    return acc.message(True)


def structural_tag(gen) -> dict:
    return json.loads(gen.sampling_params.structured_outputs["structural_tag"])["format"]


def test_named_choice_constrains_to_the_named_call_and_derender_reads_it(qwen3_xml_config):
    config = qwen3_xml_config
    req = request({"type": "function", "function": {"name": "get_weather"}})
    gen = render_chat(req, config)
    assert config.tokenizer.decode(gen.token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    tag = structural_tag(gen)
    assert (tag["type"], tag["begin"], tag["end"]) == ("tag", "<tool_call>\n<function=get_weather>\n",
                                                       "\n</function>\n</tool_call>")
    output = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
              "</parameter>\n</function>\n</tool_call>")
    batch = derender(config, req, gen, output)
    assert batch["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    assert batch["content"] == "" and batch["reasoning"] is None
    assert derender(config, req, gen, output, one_token=True) == batch


def test_required_choice_constrains_to_at_least_one_call_and_the_model_picks_it(qwen3_xml_config):
    config = qwen3_xml_config
    req = request("required")
    gen = render_chat(req, config)
    tag = structural_tag(gen)
    assert (tag["type"], tag["at_least_one"]) == ("triggered_tags", True)
    assert [t["begin"] for t in tag["tags"]] == ["<tool_call>\n<function=get_weather>\n",
                                                 "<tool_call>\n<function=get_time>\n"]
    output = "<tool_call>\n<function=get_time>\n\n</function>\n</tool_call>"
    batch = derender(config, req, gen, output)
    assert [c["function"] for c in batch["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    assert derender(config, req, gen, output, one_token=True) == batch


def test_a_cut_off_forced_call_still_has_object_arguments(qwen3_xml_config):
    config = qwen3_xml_config
    req = request({"type": "function", "function": {"name": "get_weather"}})
    gen = render_chat(req, config)
    batch = derender(config, req, gen, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs")
    assert json.loads(batch["tool_calls"][0]["function"]["arguments"]) == {"city": "Os"}


def test_a_call_an_earlier_render_opened_in_the_prompt_still_reads(qwen3_xml_config):
    # before following vLLM's structural tags, our render ended the prompt with the call's opening; a request
    # rendered that way (a stream in flight across an upgrade) derenders the model's continuation
    config = qwen3_xml_config
    req = request({"type": "function", "function": {"name": "get_weather"}})
    gen = render_chat(req, config)
    opened = msgspec.structs.replace(gen, token_ids=gen.token_ids + config.tokenizer.encode(
        "<tool_call>\n<function=get_weather>\n"), reasoning_ended=True)
    output = "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    batch = derender(config, req, opened, output)
    assert batch["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert batch["content"] == "" and batch["reasoning"] is None
    assert derender(config, req, opened, output, one_token=True) == batch


@pytest.fixture(scope="module")
def hermes_config():
    return build_render_config(load_bundle(QWEN3_FIXTURE_DIR), served_model_names=["m"], tool_call_parser="hermes",
                               enable_auto_tool_choice=True)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_hermes_constrains_a_forced_call_to_its_own_syntax_and_derender_reads_both_shapes(hermes_config, choice):
    config = hermes_config
    req = request(choice)
    gen = render_chat(req, config)
    # vLLM 0.32's structural tag (tests/test_vllm_render_parity.py holds its text equal to vLLM's own render)
    tag = json.loads(gen.sampling_params.structured_outputs["structural_tag"])["format"]
    assert tag["type"] == "tags_with_separator" and tag["stop_after_first"] is isinstance(choice, dict)
    assert {t["begin"].split('"')[3] for t in tag["tags"]} == (
        {"get_weather"} if isinstance(choice, dict) else {"get_weather", "get_time"})
    expected = {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    for output in (HERMES_CALL, HERMES_CALL.replace("\n", "")):  # the tag's two layouts
        batch = derender(config, req, gen, output)
        assert [c["function"] for c in batch["tool_calls"]] == [expected] and batch["content"] == ""
        assert derender(config, req, gen, output, one_token=True) == batch
    # the JSON shapes our earlier renders (and servers without a hermes parser) constrained to still parse
    legacy = '{"city": "Oslo", "days": 2}' if isinstance(choice, dict) else \
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]'
    batch = derender(config, req, gen, "  " + legacy)
    assert [c["function"] for c in batch["tool_calls"]] == [expected] and batch["content"] == ""
    assert derender(config, req, gen, "  " + legacy, one_token=True) == batch


@pytest.mark.slow
def test_glm47_reasons_then_writes_the_constrained_call(tmp_path):
    bundle = load_bundle(write_family_bundle("glm47", tmp_path / "glm"))
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="glm47", tool_call_parser="glm47",
                                 chat_template=(TEMPLATES / "glm-4.7-flash.jinja").read_text(encoding="utf-8"))
    req = request({"type": "function", "function": {"name": "get_weather"}})
    gen = render_chat(req, config)
    assert config.tokenizer.decode(gen.token_ids, skip_special_tokens=False).endswith("<|assistant|><think>")
    assert gen.reasoning_ended is False  # the engine applies the tag after </think>
    tag = structural_tag(gen)
    assert tag["type"] == "tags_with_separator" and tag["tags"][0]["begin"] == "<tool_call>get_weather"
    output = "Oslo.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    batch = derender(config, req, gen, output)
    assert batch["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert batch["reasoning"] == "Oslo." and batch["content"] == ""
    assert derender(config, req, gen, output, one_token=True) == batch


def test_tool_choice_none_leaves_the_markup_in_content(qwen3_xml_config):
    config = qwen3_xml_config
    req = request("none")
    gen = render_chat(req, config)
    assert gen.sampling_params.structured_outputs is None
    output = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    batch = derender(config, req, gen, output)
    assert batch["tool_calls"] == [] and batch["content"] == output
