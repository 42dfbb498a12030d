"""parsers/reasoning_count.py on real Qwen3 tokens: the count is the same for every chunking (single-token tags,
qwen3's implicit end at a tool call, tags spelled with ordinary sub-tokens), a state from before the count existed
still restores, and a client's forged count is refused where it is out of bounds."""

from __future__ import annotations

import random

import msgspec
import pytest

from render_service.parsers.base import ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig
from tests.render_harness import qwen3_bundle

PROMPT_THINKING = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def tokenizer():
    return qwen3_bundle().tokenizer


def count_for(pipeline: Pipeline, ids: list[int], cuts: list[int], prompt: list[int]) -> tuple[int, int]:
    state = pipeline.initial_state(prompt)
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        state = pipeline.restore_state(msgspec.to_builtins(state))  # as stream_state carries it
        pipeline.feed(state, ids[a:b])
    pipeline.finish(state)
    return pipeline.reasoning_tokens(state), pipeline.thinking_tokens(state)


CASES = {
    # name: (reasoning parser, tool parser, output, reasoning tokens when exact)
    "tags": ("qwen3", None, "<think>\nPlan the answer.\n</think>\n\nHello.", "\nPlan the answer.\n"),
    "implicit_end": ("qwen3", "qwen3_coder", "Plan it<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                     "Plan it"),
    "seed_spelled": ("seed_oss", None, "<seed:think>Plan the answer.</seed:think>Hello.", None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_count_does_not_depend_on_chunking(name):
    reasoning, tools, text, expected = CASES[name]
    tok = tokenizer()
    pipeline = Pipeline(tok, PipelineConfig(reasoning_parser=reasoning, tool_parser=tools, tool_choice="auto" if tools
                                            else "none", tools=[ToolSpec("get_time", {})] if tools else []))
    ids, prompt = tok.encode(text), tok.encode(PROMPT_THINKING)
    whole = count_for(pipeline, ids, [], prompt)
    rng = random.Random(name)
    for cuts in [list(range(1, len(ids))), *(sorted(rng.sample(range(1, len(ids)), 4)) for _ in range(6))]:
        assert count_for(pipeline, ids, cuts, prompt) == whole, cuts
    if expected is not None:
        assert whole[0] == len(tok.encode(expected))
    assert 0 < whole[0] <= whole[1] <= len(ids)


def test_a_state_without_the_count_restores_and_counts_on():
    tok = tokenizer()
    pipeline = Pipeline(tok, PipelineConfig(reasoning_parser="qwen3"))
    state = pipeline.initial_state(tok.encode(PROMPT_THINKING))
    pipeline.feed(state, tok.encode("<think>Hmm"))
    raw = msgspec.to_builtins(state)
    del raw["reasoning_count"]  # a stream that started before the count existed
    state = pipeline.restore_state(raw)
    pipeline.feed(state, tok.encode(" more</think>ok"))
    assert pipeline.reasoning_tokens(state) == len(tok.encode(" more"))


def test_a_forged_count_out_of_bounds_is_refused():
    tok = tokenizer()
    pipeline = Pipeline(tok, PipelineConfig(reasoning_parser="qwen3"))
    raw = msgspec.to_builtins(pipeline.initial_state(tok.encode(PROMPT_THINKING)))
    for bad in ([True, True, False, [1] * 10_000, -1, 0, 0, 0], [True, True, False, [], -1, -5, 0, 0],
                [True, True, False, [], -9, 0, 0, 0], "x"):
        with pytest.raises(msgspec.ValidationError):
            pipeline.restore_state({**raw, "reasoning_count": bad})
