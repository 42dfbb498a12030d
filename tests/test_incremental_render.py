"""Render through the prompt piece cache gives transformers' apply_chat_template ids: the shared conversations,
agent loops rendered turn by turn (including a new user turn after which Qwen3's template drops the reasoning
of every earlier turn), and generated conversations with Unicode edge cases and marker text in the content."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.agent_trace import AgentTraceSpec, agent_trace, round_ends
from render_service.templates.chat_messages import prepare_messages, prepare_tools
from render_service.tokenize.incremental_tokenizer import IncrementalEncoder
from tests.conversations import CONVERSATIONS
from tests.shared_paths import QWEN3_FIXTURE_DIR
from tests.test_incremental_tokenizer import EDGES
from tests.test_templates import Side, _inputs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def side() -> Side:
    return Side(QWEN3_FIXTURE_DIR)


@pytest.fixture(scope="module")
def encoder(side) -> IncrementalEncoder:
    """One cache for the whole module: pieces seen by one test are hits in the next; prompts from 64 characters
    on go to the prefix store too (the server's default is 1024), so short conversations reuse stored heads."""
    encoder = IncrementalEncoder(side.bundle.tokenizer, 1 << 24, prefix_base=64)
    assert encoder.enabled, encoder.reason
    return encoder


def cached_ids(side: Side, encoder: IncrementalEncoder, messages, **kwargs) -> list[int]:
    """The ids as the render server takes them: the cache's PromptIds view, read as a list."""
    return list(encoder.encode_ids(side.template.render(messages, **kwargs)))


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=lambda c: c.name)
def test_shared_conversations_miss_and_hit(side, encoder, conv):
    messages, kwargs = _inputs(conv)
    expected = side.hf_ids(messages, **kwargs)
    assert cached_ids(side, encoder, messages, **kwargs) == expected
    assert cached_ids(side, encoder, messages, **kwargs) == expected


def test_agent_loop_turn_by_turn_and_a_new_user_turn_rewriting_history(side, encoder):
    trace, tools = agent_trace(AgentTraceSpec(rounds=5, tools=3, result_chars=(300, 1200), seed=19))
    follow_up, _ = agent_trace(AgentTraceSpec(rounds=3, tools=3, result_chars=(300, 1200), seed=20))
    # After the first loop the user asks again: every earlier assistant turn now precedes the last user query,
    # so Qwen3's template drops their reasoning, and text rendered before changes.
    conversation = trace + [follow_up[1]] + follow_up[2:]
    prepared_tools = prepare_tools(tools)
    rendered = []
    reused_before = encoder.reused_tokens
    for end in round_ends(trace) + [len(trace) + 1] + [len(trace) + e - 1 for e in round_ends(follow_up)[1:]]:
        messages = prepare_messages(conversation[:end])
        text = side.template.render(messages, tools=prepared_tools, add_generation_prompt=True)
        rendered.append(text)
        assert cached_ids(side, encoder, messages, tools=prepared_tools, add_generation_prompt=True) == \
            side.hf_ids(messages, tools=prepared_tools, add_generation_prompt=True)
    reasoning = trace[2]["reasoning_content"]
    assert reasoning in rendered[len(round_ends(trace)) - 1] and reasoning not in rendered[-1]
    assert encoder.reused_tokens > reused_before  # turns took their head from the previous turn


contents = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
                              st.sampled_from(EDGES + ["<tool_call>", "</think>", "<|im_end|>", "<|im_start|>"])),
                    max_size=6).map("".join)
turns = st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), contents, contents), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(turns=turns)
def test_generated_conversations_turn_by_turn_equal_transformers(side, encoder, turns):
    messages = [{"role": "system", "content": "You are terse."}]
    for role, content, reasoning in turns:
        message = {"role": role, "content": content}
        if role == "assistant" and reasoning:
            message["reasoning_content"] = reasoning
        messages.append(message)
        if role == "assistant":
            continue
        prepared = prepare_messages(messages)
        assert cached_ids(side, encoder, prepared, add_generation_prompt=True) == \
            side.hf_ids(prepared, add_generation_prompt=True)
