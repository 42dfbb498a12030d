"""DeepSeek-V4 and V3.2 render: our templates (render_service/bundle/deepseek_v4_template.jinja, deepseek_v32_template.jinja)
give the prompt text of DeepSeek's own prompt encoders, called the way vLLM 0.33's V4 / V3.2 tokenizers call them,
on the shared conversations with thinking on and off (the same text, so the same token ids). The encoders' prompts
are recorded from vLLM 0.33 by tests/fixtures/deepseek_v4/record.py; where vLLM 0.33 is installed (bench.peers), the
recording is checked against its encoders live. The bundles carry DeepSeek-V4's real tokenizer (for V3.2 a test
tokenizer: no package ships V3's vocabulary).

DeepSeek-V4 ships no Jinja template, so transformers' apply_chat_template has nothing to run; the encoder is the
model's reference, as the template is for the other families.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from bench import peers
from render_service.bundle.model_bundle import load_bundle
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import write_family_bundle
from tests.fixtures.deepseek_v4 import record
from tests.fixtures.deepseek_v4.record import V4, V32, Family, setting_id

RERECORD = f"conversations or settings changed since the recording: re-record with `.venv/bin/python -m {record.__name__}`"


def recorded(family: Family) -> dict[str, Any]:
    return json.loads(family.fixture.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    bundle = load_bundle(write_family_bundle("deepseek_v4", tmp_path_factory.mktemp("dsv4") / "b"))
    return build_render_config(bundle, served_model_names=["m"], reasoning_parser="auto", tool_call_parser="auto")


@pytest.mark.parametrize("switches", V4.settings, ids=setting_id)
def test_prompts_equal_deepseeks_encoder(config, switches):
    assert_renders_like(config, V4, switches)


def assert_renders_like(config, family: Family, switches: dict) -> None:
    """On every shared conversation (at least 10 rendered) our template gives the encoder's recorded prompt text;
    where the encoder refused a conversation, so must we."""
    recording = recorded(family)
    assert setting_id(switches) in recording["settings"], RERECORD
    rendered = 0
    for case in record.cases():
        entry = recording["cases"].get(case.name)
        assert entry is not None and entry["inputs"] == case.digest, f"{case.name}: {RERECORD}"
        reference = entry["prompts"][setting_id(switches)]
        kwargs = case.kwargs | switches
        if isinstance(reference, dict):  # the encoder refuses it (e.g. a thinking turn without reasoning)
            with pytest.raises(Exception):  # noqa: B017
                config.template.render(case.messages, tools=case.tools, **kwargs)
            continue
        reference_text = recording["texts"][reference]
        ours = config.template.render(case.messages, tools=case.tools, **kwargs)
        assert ours == reference_text, case.name  # the same text: the same token ids, with any tokenizer
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

@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    root = write_family_bundle("deepseek_v4", tmp_path_factory.mktemp("dsv32") / "b")
    (root / "config.json").write_text('{"model_type": "deepseek_v32", "max_position_embeddings": 131072}')
    return build_render_config(load_bundle(root), served_model_names=["m"], reasoning_parser="auto",
                               tool_call_parser="auto")


@pytest.mark.parametrize("switches", V32.settings, ids=setting_id)
def test_v32_prompts_equal_deepseeks_encoder(v32, switches):
    assert (v32.reasoning_parser, v32.tool_call_parser) == ("deepseek_v4", "deepseek_v32")
    assert_renders_like(v32, V32, switches)


# --- the recording against vLLM 0.33 itself -------------------------------------------------------------------


@pytest.mark.vllm_peer("0.33")
@pytest.mark.parametrize("family", [V4, V32], ids=lambda f: f.encoder)
def test_the_recording_is_what_vllm_033s_encoders_give(family):
    venv = peers.vllm033_venv()
    if venv is None:
        pytest.skip(f"no vLLM 0.33 venv in {[str(v) for v in peers.VLLM033_VENVS]} (set $SPLITSERVE_VLLM033)")
    want = recorded(family)
    version = record.vllm_version(venv)
    if version != want["vllm"]:
        pytest.skip(f"{venv} has vLLM {version}; the recording is {want['vllm']}'s")
    assert record.record(family, record.load_encoder(venv, family), version) == want, RERECORD


def test_the_requests_reasoning_effort_reaches_the_template(config):
    def prompt(**extra) -> str:
        req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **extra},
                              ChatCompletionRequest)
        return config.tokenizer.decode(render_chat(req, config).token_ids, skip_special_tokens=False)

    assert "Reasoning Effort: Absolute maximum" in prompt()  # thinking on: "high" unless asked otherwise
    assert "Reasoning Effort: Beyond maximum" in prompt(reasoning_effort="max")
    assert "Reasoning Effort" not in prompt(reasoning_effort="low")
    assert prompt(reasoning_effort="none").endswith("<\uff5cAssistant\uff5c></think>")
