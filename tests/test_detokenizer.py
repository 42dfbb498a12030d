"""Incremental detokenizer: byte-level fast path and general window path against vLLM's offset algorithm."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.detokenizer import DetokenizerConfig, DetokenizerState, IncrementalDetokenizer
from render_service.tokenize.tokenizer import TextTokenizer
from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR

QWEN = str(SHARED / "fixtures/qwen3-0.6b")


@lru_cache(maxsize=1)
def qwen():
    return load_bundle(QWEN).tokenizer


def vllm_reference(tok: TextTokenizer, prompt_ids: list[int], output_ids: list[int], skip_special: bool) -> list[str]:
    """vLLM's detokenize_incrementally, written out plainly (untrimmed window, convert_tokens_to_string =
    the tokenizer's decoder over token strings), one step per token."""
    hf = tok.hf

    def to_tokens(ids):
        return [hf.id_to_token(i) for i in ids if not (skip_special and i in tok.special_token_ids)]

    tokens = to_tokens(prompt_ids[-7:])
    read = len(tokens)
    prefix = max(read - 5, 0)
    out = []
    for t in output_ids:
        tokens = tokens + to_tokens([t])
        prefix_text = hf.decoder.decode(tokens[prefix:read])
        new_text = hf.decoder.decode(tokens[prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(new_text[len(prefix_text):])
        prefix, read = read, len(tokens)
    return out


def stream(detok: IncrementalDetokenizer, ids: list[int], prompt=None) -> list[str]:
    state = detok.initial_state(prompt)
    return [detok.step(state, [t]) for t in ids]


TEXTS = [
    "Hello world",
    "emoji 😀 and 👩‍👩‍👧 family",
    "中文字符测试，日本語もある",
    "<think>\nhmm</think>\n\n<tool_call>\n{\"a\": 1}\n</tool_call>",
    "tabs\tand\nnewlines  and   spaces",
]


def test_byte_level_matches_vllm_per_token_on_real_qwen_text():
    tok = qwen()
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=False))
    assert detok.is_byte_level
    for text in TEXTS:
        ids = tok.encode(text)
        assert stream(detok, ids) == vllm_reference(tok, [], ids, skip_special=False)
        assert "".join(stream(detok, ids)) == text


@st.composite
def byte_soup(draw):
    """Random Qwen token ids biased towards single-byte tokens that split multi-byte characters."""
    tok = qwen()
    emoji_bytes_tokens = tok.encode("😀🎉中")
    pool = st.one_of(
        st.integers(0, 255),  # the 256 byte-level base tokens (many are partial UTF-8)
        st.sampled_from(emoji_bytes_tokens),
        st.integers(0, 151668),
    )
    return draw(st.lists(pool, min_size=1, max_size=30))


@settings(max_examples=150, deadline=None)
@given(byte_soup(), st.booleans())
def test_byte_level_equals_vllm_offset_algorithm_for_random_ids(ids, skip_special):
    tok = qwen()
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=skip_special))
    assert stream(detok, ids) == vllm_reference(tok, [], ids, skip_special=skip_special)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab 😀中é\n")), min_size=1, max_size=20), st.data())
def test_chunking_does_not_change_text(text, data):
    tok = qwen()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode(text)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1)))))
    state = detok.initial_state()
    pieces, start = [], 0
    for c in [*cuts, len(ids)]:
        pieces.append(detok.step(state, ids[start:c]))
        start = c
    assert "".join(pieces) == text


def test_emoji_split_across_tokens_appears_on_its_last_byte():
    tok = qwen()
    detok = IncrementalDetokenizer(tok)
    smile = list("😀".encode())
    byte_ids = [tok.token_to_id(_byte_token(b)) for b in smile]
    state = detok.initial_state()
    assert [detok.step(state, [i]) for i in byte_ids] == ["", "", "", "😀"]


def test_character_incomplete_at_end_is_dropped_not_flushed():
    """V-D02: the partial emoji never appears, and never as U+FFFD."""
    tok = qwen()
    detok = IncrementalDetokenizer(tok)
    state = detok.initial_state()
    ids = tok.encode("Hi ") + [tok.token_to_id(_byte_token(b)) for b in "😀".encode()[:2]]
    assert detok.step(state, ids) == "Hi "
    assert state.pending == "😀".encode()[:2]


def test_skip_special_tokens_hides_im_end_but_keeps_think():
    tok = qwen()
    ids = [151667] + tok.encode("x") + [151668, 151645]
    shown = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=False))
    hidden = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=True))
    assert shown.step(shown.initial_state(), ids) == "<think>x</think><|im_end|>"
    assert hidden.step(hidden.initial_state(), ids) == "<think>x</think>"


def test_hidden_token_ids_drop_eos_even_when_specials_are_kept():
    tok = qwen()
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=False, hidden_token_ids=frozenset({151645})))
    assert detok.step(detok.initial_state(), tok.encode("ok") + [151645]) == "ok"


def test_out_of_vocab_id_yields_no_text():
    tok = qwen()
    detok = IncrementalDetokenizer(tok)
    state = detok.initial_state()
    assert detok.step(state, [10**9, -1] + tok.encode("a")) == "a"


# general (window) path on a Metaspace tokenizer ------------------------------------------------------


def _byte_token(b: int) -> str:
    from render_service.tokenize.byte_level import BYTE_TO_CHAR

    return BYTE_TO_CHAR[b]


@lru_cache(maxsize=1)
def metaspace_tokenizer() -> TextTokenizer:
    words = ["▁Hello", "▁world", "▁the", "▁cat", "▁", "s", "a", "t", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(words)}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    hf.add_special_tokens(["</s>"])
    return TextTokenizer(hf, {vocab["</s>"]})


def test_general_path_matches_vllm_reference_with_prompt_seed():
    tok = metaspace_tokenizer()
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=True))
    assert not detok.is_byte_level
    v = tok.hf.get_vocab()
    prompt = [v["▁the"], v["▁cat"]]
    out = [v["▁Hello"], v["<0xF0>"], v["<0x9F>"], v["<0x98>"], v["<0x80>"], v["▁world"], v["</s>"], v["s"]]
    got = stream(detok, out, prompt)
    assert got == vllm_reference(tok, prompt, out, skip_special=True)
    assert got[0] == " Hello"  # the prompt seed keeps the leading space


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 14), min_size=1, max_size=25), st.lists(st.integers(0, 14), max_size=8))
def test_general_path_equals_vllm_reference_for_random_ids(out, prompt):
    tok = metaspace_tokenizer()
    detok = IncrementalDetokenizer(tok, DetokenizerConfig(skip_special_tokens=True))
    assert stream(detok, out, prompt) == vllm_reference(tok, prompt, out, skip_special=True)


def test_general_path_window_stays_bounded():
    tok = metaspace_tokenizer()
    detok = IncrementalDetokenizer(tok)
    v = tok.hf.get_vocab()
    state = detok.initial_state()
    for _ in range(500):
        detok.step(state, [v["▁Hello"], v["▁world"]])
    assert len(state.window) <= 8
    assert isinstance(state, DetokenizerState)
