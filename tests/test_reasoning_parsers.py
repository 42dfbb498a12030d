"""Reasoning parsers: parser-semantics.md §6.1 vectors, splits across chunks, the prompt-tail rule."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.base import ReasoningParserConfig
from render_service.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Qwen3ReasoningParser,
    reasoning_open_at_prompt_end,
)
from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR


@lru_cache(maxsize=1)
def qwen():
    return load_bundle(str(SHARED / "fixtures/qwen3-0.6b")).tokenizer


def run(parser, chunks):
    """(reasoning, content) as a client reconstructs them: None when that channel never got text."""
    state = parser.initial_state()
    pieces = []
    for c in chunks:
        pieces += parser.feed(state, c)
    pieces += parser.finish(state)
    assert all(p.text for p in pieces), "no empty pieces"
    r = "".join(p.text for p in pieces if p.channel == "reasoning")
    c = "".join(p.text for p in pieces if p.channel == "content")
    return (r or None), (c or None)


def qwen3(**kw):
    return Qwen3ReasoningParser(ReasoningParserConfig(**kw))


def r1(**kw):
    return DeepSeekR1ReasoningParser(ReasoningParserConfig(**kw))


def test_v_r01_qwen3_keeps_whitespace_around_tags():
    text = "<think>\nThe user wants 2+2.\n</think>\n\n2 + 2 = 4."
    assert run(qwen3(), [text]) == ("\nThe user wants 2+2.\n", "\n\n2 + 2 = 4.")
    # as the model streams it: one tag per chunk, the tags alone produce nothing
    state = qwen3().initial_state()
    p = qwen3()
    assert p.feed(state, "<think>") == []
    assert [x.channel for x in p.feed(state, "\nThe")] == ["reasoning"]
    assert p.feed(state, "</think>") == []


def test_v_r03_qwen3_truncated_output_is_reasoning():
    assert run(qwen3(), ["<think>\nStep 1: consider"]) == ("\nStep 1: consider", None)


def test_v_r04_thinking_disabled_everything_is_content():
    text = "Paris is the capital of France."
    assert run(qwen3(enable_thinking=False), [text]) == (None, text)
    # the prompt closed reasoning (<think>\n\n</think>\n\n): content for qwen3 and, unlike vLLM#19222, for r1
    assert run(qwen3(reasoning_open_at_start=False), [text]) == (None, text)
    assert run(r1(reasoning_open_at_start=False), [text]) == (None, text)


def test_v_r06_qwen3_no_tags_is_reasoning_when_thinking():
    assert run(qwen3(), ["Hi!"]) == ("Hi!", None)


def test_v_r07_r1_empty_reasoning_is_not_sent():
    assert run(r1(), ["</think>This is the rest"]) == (None, "This is the rest")


def test_v_r09_r1_leading_newline_before_think_is_dropped_in_both_modes():
    text = "\n<think>This is a reasoning section</think>\nThis is the rest"
    expected = ("This is a reasoning section", "\nThis is the rest")
    assert run(r1(), [text]) == expected
    assert run(r1(), list(text)) == expected  # one character per chunk: the batch answer, not vLLM's stream one


def test_v_r10_r1_reasoning_only():
    assert run(r1(), ["This is a reasoning section</think>"]) == ("This is a reasoning section", None)


def test_v_r13_deepseek_v3_identity_unless_thinking():
    off = DeepSeekV3ReasoningParser(ReasoningParserConfig(enable_thinking=DeepSeekV3ReasoningParser.enable_thinking_from({})))
    assert run(off, ["<think>x</think>y"]) == (None, "<think>x</think>y")
    on_flag = DeepSeekV3ReasoningParser.enable_thinking_from({"thinking": True})
    on = DeepSeekV3ReasoningParser(ReasoningParserConfig(enable_thinking=on_flag))
    assert run(on, ["x</think>y"]) == ("x", "y")


def test_qwen3_thinking_kwarg_defaults():
    assert Qwen3ReasoningParser.enable_thinking_from(None) is True
    assert Qwen3ReasoningParser.enable_thinking_from({"enable_thinking": False}) is False
    assert DeepSeekR1ReasoningParser.enable_thinking_from({"thinking": False}) is True


def test_qwen3_implicit_end_at_tool_call_with_function():
    text = "plan<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    reasoning, content = run(qwen3(), [text])
    assert reasoning == "plan"
    assert content.startswith("<tool_call>\n<function=get_weather>")


def test_qwen3_tool_call_without_function_stays_reasoning():
    text = 'plan<tool_call>\n{"name": "f"}</think>answer'
    assert run(qwen3(), [text]) == ('plan<tool_call>\n{"name": "f"}', "answer")


def test_qwen3_buffered_tool_call_released_once_it_cannot_be_an_implicit_end():
    p = qwen3()
    state = p.initial_state()
    assert [x.text for x in p.feed(state, "a<tool_call>")] == ["a"]
    assert p.feed(state, "\n") == []
    assert p.feed(state, "<fun") == []
    assert [(x.channel, x.text) for x in p.feed(state, "k")] == [("reasoning", "<tool_call>\n<funk")]


def test_r1_ignores_tool_call_marker():
    assert run(r1(), ["a<tool_call>\n<function=f>"]) == ("a<tool_call>\n<function=f>", None)


def test_stop_desync_vector_v_r21_text_split_inside_end_tag():
    """V-R21: "</" arrives before "think> Hello": we hold the partial tag, so no "</" leaks anywhere."""
    p = r1()
    assert run(p, ["<think>I have a plan", "</", "think> Hello"]) == ("I have a plan", " Hello")


TEXTS = [
    "<think>\nabc\n</think>\n\nanswer",
    "  \n<think>x</think>y",
    "no tags at all <thin",
    "a</think",
    "</think>",
    "<think></think>",
    "r<tool_call>  <function=f>x</tool_call>",
    "r<tool_call> {\"x\": 1}</think>c<tool_call>\n<function=g>",
    "<<think>>",
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.data(), st.sampled_from(["qwen3", "deepseek_r1", "deepseek_v3_on"]))
def test_any_chunking_gives_the_batch_result(text, data, name):
    make = {
        "qwen3": lambda: qwen3(),
        "deepseek_r1": lambda: r1(),
        "deepseek_v3_on": lambda: DeepSeekV3ReasoningParser(ReasoningParserConfig(enable_thinking=True)),
    }[name]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=len(text))))
    chunks, start = [], 0
    for c in [*cuts, len(text)]:
        chunks.append(text[start:c])
        start = c
    assert run(make(), chunks) == run(make(), [text])


def test_prompt_tail_decides_reasoning_state():
    tok = qwen()
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assistant = tok.encode("assistant\n")
    nl = tok.encode("\n\n")
    # Qwen3 enable_thinking=False wrote an empty think block: reasoning is closed
    assert reasoning_open_at_prompt_end([im_start, *assistant, think, *nl, end, *nl], tok, Qwen3ReasoningParser) is False
    # Qwen3.5-style template opened <think>: reasoning is open
    assert reasoning_open_at_prompt_end([im_start, *assistant, think, *tok.encode("\n")], tok, Qwen3ReasoningParser) is True
    # an earlier turn's </think> does not count (vLLM PR #32490): the turn boundary stops the scan
    earlier = [im_start, *assistant, think, end, *tok.encode("Hello!"), im_end, *tok.encode("\n")]
    assert reasoning_open_at_prompt_end([*earlier, im_start, *assistant], tok, Qwen3ReasoningParser) is None
    assert reasoning_open_at_prompt_end(None, tok, Qwen3ReasoningParser) is None
