"""Kimi-K2 thinking, Llama 4, Granite 4 and Magistral: render with the models' real chat templates
(tests/fixtures/templates, sources in its README) gives the token IDs of transformers' apply_chat_template on
the shared conversations (tools, tool results, multi-turn, reasoning kept or dropped as the template does).

The tokenizers are TEST tokenizers with each family's special tokens at their real ids (tests/family_bundles.py):
Kimi on Qwen3's BPE, Llama 4 on Llama 3's ranks (quicktok-v1), Granite 4 on cl100k's ranks (quicktok-v1),
Magistral on Qwen3's BPE above tekken's 1000 control ids; no package ships these models' own tokenizers.
Magistral's template is the one mistral-common generates for a v13 tekken tokenizer with thinking.
"""

from __future__ import annotations

import pytest

from tests.conversations import CONVERSATIONS, by_name
from tests.family_bundles import write_family_bundle
from tests.test_family_templates import _render_both
from tests.test_templates import Side, _inputs

transformers = pytest.importorskip("transformers")

# loading each test tokenizer twice (ours and transformers') takes seconds on a loaded 2-core machine
pytestmark = pytest.mark.slow

FAMILIES = ("kimi_k2", "llama4", "granite4", "magistral")


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, Side]:
    root = tmp_path_factory.mktemp("family-bundles-more")
    return {family: Side(write_family_bundle(family, root / family)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_token_ids_equal_transformers_on_every_conversation(sides, family):
    rendered = 0
    for conv in CONVERSATIONS:
        messages, kwargs = _inputs(conv)
        ours, ref = _render_both(sides[family], messages, kwargs)
        if ours is not None:
            assert ours == ref, conv.name
            rendered += 1
    assert rendered >= 10


def test_kimi_keeps_reasoning_only_after_the_last_plain_answer(sides):
    side = sides["kimi_k2"]
    messages, kwargs = _inputs(by_name("reasoning_content_in_history"))
    text = side.template.render(messages, **kwargs)
    # earlier turns' reasoning is dropped (an empty think block), the generation prompt opens no <think>
    assert "<think></think>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")


def test_llama4_writes_calls_as_json_with_parameters(sides):
    side = sides["llama4"]
    messages, kwargs = _inputs(by_name("tool_call_arguments_dict"))
    text = side.template.render(messages, **kwargs)
    assert "<|python_start|>Checking.<|python_end|>{\"name\": \"get_weather\", \"parameters\": {" in text


def test_granite4_writes_hermes_style_calls(sides):
    side = sides["granite4"]
    messages, kwargs = _inputs(by_name("tool_call_arguments_dict"))
    text = side.template.render(messages, **kwargs)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {' in text


def test_magistral_writes_thinking_chunks_and_v13_calls(sides):
    side = sides["magistral"]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool"},
                                                  {"type": "text", "text": "Checking."}]}]
    text = side.template.render(messages)
    assert "[THINK]use the tool[/THINK]Checking." in text
    assert side.our_ids(messages) == side.hf_ids(messages)
    messages, kwargs = _inputs(by_name("tool_call_arguments_dict"))
    assert "[TOOL_CALLS]get_weather[ARGS]{" in side.template.render(messages, **kwargs)
