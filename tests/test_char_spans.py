"""Tokens' character spans from their bytes equal the offsets ``tokenizers`` reports from its own encode."""

from __future__ import annotations

import random

import pytest

from render_service.tokenize.char_spans import char_span_array
from tests.render_harness import qwen3_config

# Multi-byte characters split by byte-level merges, emoji sequences, full-width letters, added tokens, controls.
PIECES = ["hello", " world", "😀", "日本語", "é", "<|im_start|>", "<|im_end|>", "\n", "  ", "\t", "ünïcødé", "🇫🇷",
          "🧑\u200d🚀", '{"a": 1}', "ＡＢＣ", "x" * 50, "<think>", "</tool_call>", "\u0000", "\r\n"]


def test_spans_equal_the_offsets_of_tokenizers_on_mixed_text():
    tokenizer = qwen3_config().tokenizer
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text)
        encoding = tokenizer.hf.encode(text, add_special_tokens=False)
        assert list(encoding.ids) == ids
        spans = char_span_array(tokenizer, text, ids)
        assert spans is not None and spans.tolist() == [list(o) for o in encoding.offsets], repr(text)


@pytest.mark.parametrize("text", ["cafe\u0301", "e\u0301 and more"])
def test_text_a_normalizer_changes_gets_none(text):
    """The ids spell the normalised bytes, not the text's: the caller must ask tokenizers instead."""
    tokenizer = qwen3_config().tokenizer
    assert char_span_array(tokenizer, text, tokenizer.encode(text)) is None


def test_ids_that_are_not_the_texts_get_none():
    tokenizer = qwen3_config().tokenizer
    ids = tokenizer.encode("hello world")
    assert char_span_array(tokenizer, "hello there", ids) is None
    assert char_span_array(tokenizer, "hello world", ids[:-1]) is None
    empty = char_span_array(tokenizer, "", [])
    assert empty is not None and empty.shape == (0, 2)
