"""DeepSeek-V4 and V3.2 render: our templates (render_service/deepseek_v4_template.jinja, deepseek_v32_template.jinja)
give the token ids of DeepSeek's own prompt encoders (tests/fixtures/deepseek_v4, vLLM 0.33's copies) called the
way vLLM's V4 / V3.2 tokenizers call them, on the shared conversations with thinking on and off, with
DeepSeek-V4's real tokenizer (for V3.2 a test tokenizer: no package ships V3's vocabulary).

DeepSeek-V4 ships no Jinja template, so transformers' apply_chat_template has nothing to run; the encoder is the
model's reference, as the template is for the other families.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import msgspec
import pytest

from render_service.bundle import load_bundle
from render_service.protocol import ChatCompletionRequest
from render_service.render import render_chat
from render_service.render_config import build_render_config
from tests.conversations import CONVERSATIONS
from tests.family_bundles import write_family_bundle
from tests.test_templates import _inputs

ORACLE_PATH = Path(__file__).resolve().parent / "fixtures" / "deepseek_v4" / "deepseek_v4_encoding.py"


@pytest.fixture(scope="module")
def oracle():
    spec = importlib.util.spec_from_file_location("deepseek_v4_encoding_fixture", ORACLE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    bundle = load_bundle(write_family_bundle("deepseek_v4", tmp_path_factory.mktemp("dsv4") / "b"))
    return build_render_config(bundle, served_model_names=["m"], reasoning_parser="auto", tool_call_parser="auto")


def vllm_v4_prompt(oracle, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    """vLLM 0.33's V4 apply_chat_template (vllm/tokenizers/deepseek_v4.py), restated: the switches, the tools
    put into the first system message, then DeepSeek's encoder."""
    thinking = bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
    if "thinking" not in kwargs and "enable_thinking" not in kwargs:
        thinking = True
    mode = "thinking" if thinking else "chat"
    messages = [copy.deepcopy(m) for m in messages]
    if tools:
        at = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
        if at is None:
            messages.insert(0, {"role": "system"})
            at = 0
        messages[at]["tools"] = tools
    effort = kwargs.get("reasoning_effort")
    if not isinstance(effort, str):
        effort = "high" if thinking else None
    elif effort == "none":
        mode, effort = "chat", None
    elif effort in ("low", "minimal", "medium"):
        effort = "low"
    elif effort != "max":
        effort = "high"
    return oracle.encode_messages(messages, thinking_mode=mode, drop_thinking=kwargs.get("drop_thinking", True),
                                  reasoning_effort=effort)


SWITCHES = [{}, {"thinking": False}, {"enable_thinking": True, "reasoning_effort": "max"},
            {"reasoning_effort": "none"}, {"thinking": True, "drop_thinking": False}]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_token_ids_equal_deepseeks_encoder(config, oracle, switches):
    assert_renders_like(config, lambda m, t, k: vllm_v4_prompt(oracle, m, t, k), switches)


def assert_renders_like(config, reference_prompt, switches: dict) -> None:
    """Our template's token ids equal the encoder's on every shared conversation it renders (at least 10); where
    the encoder refuses a conversation, so must we."""
    tok = config.tokenizer
    rendered = 0
    for conv in CONVERSATIONS:
        if conv.kwargs.get("continue_final_message"):
            continue  # the generic cut after the final message (ChatTemplate, as transformers) is not the encoder's
        messages, kwargs = _inputs(conv)
        tools = kwargs.pop("tools", None)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("enable_thinking", "documents")} | switches
        try:
            reference = reference_prompt(messages, tools, kwargs)
        except Exception:  # noqa: BLE001 - the encoder refuses it (e.g. an empty developer turn): ours must too
            with pytest.raises(Exception):  # noqa: B017
                config.template.render(messages, tools=tools, **kwargs)
            continue
        ours = config.template.render(messages, tools=tools, **kwargs)
        assert tok.encode(ours) == tok.encode(reference), conv.name
        rendered += 1
    assert rendered >= 10


def test_the_bundle_gets_the_builtin_template_and_auto_picks_deepseek_v4(config):
    assert config.template is not None
    assert (config.reasoning_parser, config.tool_call_parser) == ("deepseek_v4", "deepseek_v4")


@pytest.mark.parametrize("kwargs, tail", [({}, "<\uff5cAssistant\uff5c><think>"),
                                          ({"thinking": False}, "<\uff5cAssistant\uff5c></think>")])
def test_render_chat_ends_with_the_thinking_switch_and_derender_reads_the_tail(config, kwargs, tail):
    req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                           "chat_template_kwargs": kwargs}, ChatCompletionRequest)
    gen = render_chat(req, config)
    assert config.tokenizer.decode(gen.token_ids, skip_special_tokens=False).endswith(tail)
    assert gen.reasoning_ended is (not kwargs == {})


# --- DeepSeek-V3.2 -----------------------------------------------------------------------------------------

V32_ORACLE_PATH = ORACLE_PATH.parent / "deepseek_v32_encoding.py"


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("deepseek_v32_encoding_fixture", V32_ORACLE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = write_family_bundle("deepseek_v4", tmp_path_factory.mktemp("dsv32") / "b")
    (root / "config.json").write_text('{"model_type": "deepseek_v32", "max_position_embeddings": 131072}')
    config = build_render_config(load_bundle(root), served_model_names=["m"], reasoning_parser="auto",
                                 tool_call_parser="auto")
    return module, config


def vllm_v32_prompt(oracle, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    """vLLM 0.33's V3.2 apply_chat_template (vllm/tokenizers/deepseek_v32.py), restated."""
    thinking = kwargs.get("thinking", False) or kwargs.get("enable_thinking", False)
    messages = [copy.deepcopy(m) for m in messages]
    if tools:
        messages.insert(0, {"role": "system", "tools": tools})
    return oracle.encode_messages(messages, thinking_mode="thinking" if thinking else "chat",
                                  drop_thinking=messages[-1]["role"] == "user")


@pytest.mark.parametrize("switches", [{}, {"thinking": True}, {"enable_thinking": True}],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_v32_token_ids_equal_deepseeks_encoder(v32, switches):
    oracle, config = v32
    assert (config.reasoning_parser, config.tool_call_parser) == ("deepseek_v4", "deepseek_v32")
    assert_renders_like(config, lambda m, t, k: vllm_v32_prompt(oracle, m, t, k), switches)


def test_the_requests_reasoning_effort_reaches_the_template(config):
    def prompt(**extra) -> str:
        req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **extra},
                              ChatCompletionRequest)
        return config.tokenizer.decode(render_chat(req, config).token_ids, skip_special_tokens=False)

    assert "Reasoning Effort: Absolute maximum" in prompt()  # thinking on: "high" unless asked otherwise
    assert "Reasoning Effort: Beyond maximum" in prompt(reasoning_effort="max")
    assert "Reasoning Effort" not in prompt(reasoning_effort="low")
    assert prompt(reasoning_effort="none").endswith("<\uff5cAssistant\uff5c></think>")
