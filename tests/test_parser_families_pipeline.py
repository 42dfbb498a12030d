"""The GLM, MiniMax-M2, Seed-OSS and Qwen3 XML families end to end: their reasoning parsers, and the whole
derender pipeline over token IDs (one token per chunk, random chunks, each state through a stream_state
round trip) against batch derender, with the family's tokenizer (test tokenizers for GLM / MiniMax / Seed,
tests/family_bundles.py; Qwen3's real one for qwen3_xml).
"""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ReasoningParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.reasoning import reasoning_open_at_prompt_end
from render_service.parsers.registry import REASONING_PARSERS, get_reasoning_parser
from tests.family_bundles import write_family_bundle
from tests.test_pipeline import stream_fold
from tests.test_reasoning_parsers import run


def parser(name, **config):
    return get_reasoning_parser(name)(ReasoningParserConfig(**config))


def test_upstream_names_are_registered():
    assert {"glm45", "glm47", "minimax_m2", "minimax_m2_append_think", "seed_oss", "qwen3"} <= set(REASONING_PARSERS)


@pytest.mark.parametrize("name", ["glm45", "glm47", "minimax_m2"])
def test_think_block_then_content(name):
    assert run(parser(name), ["<think>Let me see.</think>\nAnswer."]) == ("Let me see.", "\nAnswer.")
    # the template put <think> in the prompt (GLM-4.7, MiniMax-M2): the output starts in reasoning
    assert run(parser(name), ["Let me see.</think>Answer."]) == ("Let me see.", "Answer.")
    assert run(parser(name), ["cut off in thought"]) == ("cut off in thought", None)


@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_glm_thinking_off_is_all_content(name):
    cls = get_reasoning_parser(name)
    assert cls.enable_thinking_from({"enable_thinking": False}) is False
    assert run(parser(name, enable_thinking=False), ["<tool_call>f</tool_call>"]) == (None, "<tool_call>f</tool_call>")


def test_minimax_always_thinks():
    assert get_reasoning_parser("minimax_m2").enable_thinking_from({"enable_thinking": False}) is True


def test_seed_oss_tags_and_budget_reflections_stay_reasoning():
    text = "<seed:think>step<seed:cot_budget_reflect>used 10</seed:cot_budget_reflect>done</seed:think>Hi"
    assert run(parser("seed_oss"), [text]) == (
        "step<seed:cot_budget_reflect>used 10</seed:cot_budget_reflect>done", "Hi")
    assert run(parser("seed_oss"), list(text)) == run(parser("seed_oss"), [text])
    # <think> is not Seed's tag
    assert run(parser("seed_oss"), ["a</think>b"]) == ("a</think>b", None)


def test_append_think_puts_the_prompts_think_back_in_front_of_the_content():
    p = parser("minimax_m2_append_think")
    assert run(p, ["why</think>\n\nbecause"]) == (None, "<think>why</think>\n\nbecause")
    assert run(p, list("why</think>x")) == (None, "<think>why</think>x")
    assert run(p, []) == (None, "<think>")  # vLLM's batch answer for an empty output


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["glm45", "glm47", "minimax_m2", "seed_oss", "minimax_m2_append_think"]),
       st.lists(st.sampled_from(["<think>", "</think>", "<seed:think>", "</seed:think>", "<", "/", "x", " ", "\n",
                                 "<tool_call>", "😀"]), max_size=20), st.lists(st.integers(0, 60), max_size=8))
def test_property_any_split_gives_the_batch_answer(name, words, cuts):
    text = "".join(words)
    points = sorted({c for c in cuts if 0 < c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = run(parser(name), [text])
    assert run(parser(name), chunks) == whole
    assert run(parser(name), list(text)) == whole
    if name != "minimax_m2_append_think":
        # nothing lost: reasoning + content is the text less the tags the parser consumed
        joined = (whole[0] or "") + (whole[1] or "")
        assert len(joined) <= len(text)


# --- the pipeline over real token IDs ---------------------------------------------------------------------

TOOLS = [
    ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}),
    ToolSpec(name="get_time", parameters={"type": "object", "properties": {}}),
]

# family -> (reasoning parser, tool parser, prompt tail that opens reasoning (None: the model writes <think>),
#            output)
SCENARIOS = {
    "glm45": ("glm45", "glm45", None,
              "<think>Need the weather 😀.</think>\nChecking.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
              "<arg_value>Seoul 🌧</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
    "glm47": ("glm47", "glm47", "<|assistant|><think>",
              "Need the weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Seoul</arg_value>"
              "</tool_call><tool_call>get_time</tool_call>"),
    "minimax_m2": ("minimax_m2", "minimax_m2", "]~b]ai\n<think>\n",
                   "Weather then time.\n</think>\n\nOn it.<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
                   "<parameter name=\"city\">Seoul</parameter>\n<parameter name=\"days\">null</parameter>\n"
                   "</invoke>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>"),
    "seed_oss": ("seed_oss", "seed_oss", None,
                 "<seed:think>Weather.</seed:think>Sure.<seed:tool_call>\n<function=get_weather>\n"
                 "<parameter=city>Seoul</parameter>\n<parameter=days>2</parameter>\n</function>\n</seed:tool_call>"),
    "qwen3_xml": ("qwen3", "qwen3_xml", None,
                  "<think>\nWeather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSeoul\n"
                  "</parameter>\n</function>\n</tool_call>"),
}


@functools.cache
def tokenizer(family: str, root: str):
    from pathlib import Path

    return load_bundle(write_family_bundle("glm45" if family == "glm47" else family, Path(root) / family)).tokenizer


@pytest.fixture(scope="module")
def bundles_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("family-pipeline"))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SCENARIOS))
def test_one_token_streaming_equals_batch_with_the_familys_tokens(bundles_root, family):
    reasoning, tools, prompt_tail, text = SCENARIOS[family]
    tok = tokenizer(family, bundles_root)
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser=reasoning, tool_parser=tools,
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    prompt = tok.encode(prompt_tail) if prompt_tail else None
    ids = tok.encode(text)
    batch, _ = derender_all(pipeline, ids, prompt_token_ids=prompt)
    assert stream_fold(pipeline, ids, list(range(1, len(ids))), prompt) == batch
    assert stream_fold(pipeline, ids, [len(ids) // 3, len(ids) // 2], prompt) == batch
    assert "eather" in (batch["reasoning"] or "")
    assert batch["tool_calls"][0]["function"]["name"] == "get_weather"
    for call in batch["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    first = json.loads(batch["tool_calls"][0]["function"]["arguments"])
    assert first["city"].startswith("Seoul")
    if "days" in first:
        assert first["days"] in (None, 2, 3)  # typed by the anyOf schema
    if prompt_tail:
        assert reasoning_open_at_prompt_end(prompt, tok, get_reasoning_parser(reasoning)) is True


@pytest.mark.slow
def test_glm_thinking_off_prompt_closes_reasoning_and_an_earlier_turn_does_not_count(bundles_root):
    tok = tokenizer("glm45", bundles_root)
    cls = get_reasoning_parser("glm45")
    assert reasoning_open_at_prompt_end(tok.encode("<|user|>\nhi<|assistant|>\n<think></think>"), tok, cls) is False
    earlier = tok.encode("<|assistant|>\n<think>a</think>\nb<|user|>\nq<|assistant|>")
    assert reasoning_open_at_prompt_end(earlier, tok, cls) is None
