"""GLM-4.5/4.6, GLM-4.7, MiniMax-M2, Seed-OSS and Qwen3-Coder (qwen3_xml): render with the models' real chat
templates (tests/fixtures/templates) gives the token IDs of transformers' apply_chat_template, on the shared
conversations (tools, tool results, thinking on/off, multi-turn, reasoning kept or dropped by the template).

GLM, MiniMax and Seed use TEST tokenizers (tests/family_bundles.py: Qwen3's BPE with the family's special
tokens at the family's ids), because no package ships theirs; Qwen3 XML uses Qwen3's real tokenizer.
"""

from __future__ import annotations

import copy

import pytest

from render_service.templates.chat_template import ChatTemplate
from tests.conversations import CONVERSATIONS, by_name
from tests.family_bundles import TEMPLATES, write_family_bundle
from tests.test_templates import Side, _inputs

transformers = pytest.importorskip("transformers")

# loading each test tokenizer twice (ours and transformers') takes seconds on a loaded 2-core machine
pytestmark = pytest.mark.slow

FAMILIES = ("glm45", "glm47", "minimax_m2", "seed_oss", "qwen3_xml")

# Conversations each template cannot render in either implementation (the template itself raises or needs
# fields our shared data does not carry); both sides must then fail alike.
THINKING = {"glm45": "enable_thinking", "glm47": "enable_thinking", "seed_oss": "thinking_budget"}


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, Side]:
    root = tmp_path_factory.mktemp("family-bundles")
    sides = {family: Side(write_family_bundle(family, root / family))
             for family in FAMILIES if family != "glm47"}
    # GLM-4.7 has GLM-4.5's tokens: the same tokenizers with its own template
    glm47 = copy.copy(sides["glm45"])
    source = (TEMPLATES / "glm-4.7-flash.jinja").read_text(encoding="utf-8")
    glm47.template = ChatTemplate(source, glm47.bundle.template_special_tokens)
    glm47.hf = copy.copy(glm47.hf)
    glm47.hf.chat_template = source
    sides["glm47"] = glm47
    return sides


def _render_both(side: Side, messages, kwargs):
    try:
        ref = side.hf_ids(messages, **kwargs)
    except Exception as exc:  # the template raised: ours must refuse too
        with pytest.raises(Exception):  # noqa: B017 - any error the template raises
            side.our_ids(messages, **kwargs)
        return None, exc
    return side.our_ids(messages, **kwargs), ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=lambda c: c.name)
def test_token_ids_equal_transformers(sides, family, conv):
    messages, kwargs = _inputs(conv)
    ours, ref = _render_both(sides[family], messages, kwargs)
    if ours is not None:
        assert ours == ref


@pytest.mark.parametrize("family", FAMILIES)
def test_at_least_ten_conversations_render(sides, family):
    rendered = 0
    for conv in CONVERSATIONS:
        messages, kwargs = _inputs(conv)
        ours, ref = _render_both(sides[family], messages, kwargs)
        rendered += ours is not None and ours == ref
    assert rendered >= 10


@pytest.mark.parametrize("family", ("glm45", "glm47", "seed_oss"))
@pytest.mark.parametrize("on", [True, False])
def test_thinking_switch_renders_like_transformers(sides, family, on):
    messages, kwargs = _inputs(by_name("tools_with_system"))
    kwargs[THINKING[family]] = (True if on else False) if family != "seed_oss" else (-1 if on else 0)
    ours, ref = _render_both(sides[family], messages, kwargs)
    assert ours is not None and ours == ref


@pytest.mark.parametrize("family", ("glm45", "glm47"))
def test_glm_thinking_off_closes_reasoning_in_the_prompt(sides, family):
    side = sides[family]
    messages, kwargs = _inputs(by_name("system_and_user"))
    text = side.template.render(messages, enable_thinking=False, **kwargs)
    assert text.endswith("<|assistant|>\n<think></think>" if family == "glm45" else "<|assistant|></think>")
