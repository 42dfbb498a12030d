"""bench.datasets: vLLM's random and ShareGPT request sets, with the real Qwen3 tokenizer."""

import json

import pytest

from bench.datasets import SAMPLE_SHAREGPT, load_tokenizer, random_requests, sharegpt_requests
from tests.render_harness import QWEN3_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QWEN3_DIR)


def test_random_lengths_stay_in_the_range_ratio_and_are_seeded(tokenizer):
    reqs = random_requests(tokenizer, 20, 100, 40, range_ratio=0.5, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        assert 50 <= r.prompt_len <= 150
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False).ids)
        assert 20 <= r.expected_output_len <= 60
    assert len({r.prompt_len for r in reqs}) > 1
    again = random_requests(tokenizer, 20, 100, 40, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert random_requests(tokenizer, 1, 100, 40, seed=4)[0].prompt != reqs[0].prompt


def test_random_without_range_ratio_gives_exact_output_len(tokenizer):
    reqs = random_requests(tokenizer, 5, 64, 16, turns=3)
    assert all(r.expected_output_len == 16 and len(r.turns) == 3 for r in reqs)
    assert all(r.prompt_len <= 64 for r in reqs)


def test_bad_random_arguments_are_refused(tokenizer):
    with pytest.raises(ValueError):
        random_requests(tokenizer, 1, 10, 10, range_ratio=1.0)


def test_shipped_sharegpt_sample_loads_with_turns(tokenizer):
    reqs = sharegpt_requests(SAMPLE_SHAREGPT, tokenizer, 10, seed=0, turns=2)
    assert len(reqs) == 10
    assert all(len(r.turns) == 2 and r.turns[0] == r.prompt and r.expected_output_len >= 4 for r in reqs)
    fixed = sharegpt_requests(SAMPLE_SHAREGPT, tokenizer, 3, output_len=7)
    assert [r.expected_output_len for r in fixed] == [7, 7, 7]


def test_sharegpt_skips_short_and_malformed_entries(tmp_path, tokenizer):
    data = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long enough answer here"}]},
        {"conversations": "not a list"},
        "not an object",
        {"conversations": [{"from": "human", "value": "please explain the tides in detail"},
                           {"from": "gpt", "value": "the moon pulls the oceans toward it"}]},
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, tokenizer, 1)
    assert reqs[0].prompt == "please explain the tides in detail"
    with pytest.raises(ValueError, match="only 1 usable"):
        sharegpt_requests(path, tokenizer, 2)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(path, tokenizer, 1)
