"""Server settings that change what render produces: --chat-template, --default-chat-template-kwargs, parsers."""

from __future__ import annotations

import dataclasses

import pytest

from render_service.http.errors import ApiError
from render_service.render.render import render_chat, resolve_max_tokens
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.render_harness import VLLM_PAIRS, load_pair, qwen3_config

MESSAGES = [{"role": "user", "content": "Hi"}]


def config_with(**settings):
    """A configuration over the already loaded Qwen3 bundle (loading a tokenizer takes seconds)."""
    return build_render_config(qwen3_config(False).bundle, **settings)


def _render(config, **fields):
    return render_chat(ChatCompletionRequest(messages=MESSAGES, **fields), config)


def test_default_chat_template_kwargs_apply_and_requests_override_them():
    request, recorded = load_pair(VLLM_PAIRS / "noparsers" / "04_chat_render_no_thinking.request.json")
    config = config_with(served_model_names=["qwen3-0.6b"], default_chat_template_kwargs={"enable_thinking": False})
    without_kwargs = ChatCompletionRequest(messages=request["body"]["messages"])
    assert render_chat(without_kwargs, config).token_ids == recorded["body"]["token_ids"]
    thinking = ChatCompletionRequest(messages=request["body"]["messages"], chat_template_kwargs={"enable_thinking": True})
    assert render_chat(thinking, config).token_ids == render_chat(thinking, qwen3_config(False)).token_ids
    assert config.fingerprint != qwen3_config(False).fingerprint


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    source = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(source)
    from_file = config_with(chat_template=str(path))
    inline = config_with(chat_template=source)
    assert _render(from_file).token_ids == _render(inline).token_ids
    assert from_file.tokenizer.decode(_render(from_file).token_ids) == "[user] Hi\n"
    assert from_file.fingerprint == inline.fingerprint != qwen3_config(False).fingerprint


def test_served_model_names_all_accepted_first_one_answered():
    config = config_with(served_model_names=["a", "b"])
    assert _render(config).model == "a"
    assert _render(config, model="b").model == "b"
    with pytest.raises(ApiError) as err:
        _render(config, model="c")
    assert err.value.status == 404


def test_bad_parser_settings_fail_at_startup():
    with pytest.raises(ValueError):
        config_with(reasoning_parser="no-such-parser")
    with pytest.raises(ValueError):
        config_with(tool_call_parser="no-such-parser")
    with pytest.raises(ValueError):
        config_with(enable_auto_tool_choice=True)


def test_generation_config_max_new_tokens_is_the_default_max_tokens():
    base = qwen3_config(False).bundle
    bundle = dataclasses.replace(base, generation_config={**base.generation_config, "max_new_tokens": 100})
    config = build_render_config(bundle)
    assert _render(config).sampling_params.max_tokens == 100
    assert _render(config, max_tokens=500).sampling_params.max_tokens == 500  # the request wins, as in vLLM
    assert resolve_max_tokens(None, config.max_model_len - 10, config) == 10  # capped by the window


def test_skip_special_tokens_follows_the_parser_flags():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _render(qwen3_config(False)).sampling_params.skip_special_tokens is True
    assert _render(qwen3_config(True)).sampling_params.skip_special_tokens is False
    tool_only = config_with(tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert _render(tool_only).sampling_params.skip_special_tokens is True
    assert _render(tool_only, tools=tools).sampling_params.skip_special_tokens is False
    assert _render(tool_only, tools=tools, tool_choice="none").sampling_params.skip_special_tokens is True


def test_named_and_required_tool_choice_constrain_the_output():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"x": {"type": "string"}}}}}]
    # a server whose tool parser has no call syntax of its own to constrain (none here): vLLM's JSON shapes
    plain = config_with()
    named = _render(plain, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}},
                    response_format={"type": "json_object"})  # a forced call overrides the requested format
    assert named.sampling_params.structured_outputs == {"json": tools[0]["function"]["parameters"]}
    required = _render(plain, tools=tools, tool_choice="required")
    schema = required.sampling_params.structured_outputs["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["f"]}
    # hermes: vLLM 0.32's structural tag in the model's call syntax (tests/test_vllm_render_parity.py holds the
    # text equal to vLLM's own render)
    import json

    for choice, one in (("required", False), ({"type": "function", "function": {"name": "f"}}, True)):
        tag = json.loads(_render(qwen3_config(True), tools=tools, tool_choice=choice)
                         .sampling_params.structured_outputs["structural_tag"])["format"]
        assert tag["type"] == "tags_with_separator" and tag["at_least_one"] and tag["stop_after_first"] is one
        assert tag["tags"][0]["begin"] == '<tool_call>\n{"name": "f", "arguments": '
        assert tag["tags"][0]["content"]["json_schema"] is True  # arguments free: the tool is not strict


def test_requests_with_tools_render_with_the_bundles_tool_use_template():
    """HF's get_chat_template and vLLM pick the template named tool_use when tools are sent; --chat-template
    replaces every named template."""
    bundle = dataclasses.replace(qwen3_config(False).bundle, chat_templates={
        "default": "PLAIN {{ messages[0].content }}", "tool_use": "TOOLS {{ tools | length }}"})
    bundle = dataclasses.replace(bundle, chat_template="PLAIN {{ messages[0].content }}")
    config = build_render_config(bundle)
    tokenizer = config.tokenizer
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tokenizer.decode(_render(config).token_ids) == "PLAIN Hi"
    assert tokenizer.decode(_render(config, tools=tools, tool_choice="none").token_ids) == "TOOLS 1"
    assert config.fingerprint != build_render_config(dataclasses.replace(bundle, chat_templates={})).fingerprint
    overridden = build_render_config(bundle, chat_template="MINE")
    assert tokenizer.decode(_render(overridden, tools=tools, tool_choice="none").token_ids) == "MINE"
