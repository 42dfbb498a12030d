"""TextTokenizer: the fast paths (fastokens, tiktoken) give tokenizers' IDs exactly, or they are not used.

Tests on Qwen3's real tokenizer run twice: with the default backend choice (fastokens) and with
SPLITSERVE_TOKENIZER_BACKEND=tiktoken, the path taken where fastokens does not qualify."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from render_service.tokenize.byte_level import byte_level_bpe_spec
from render_service.tokenize.tiktoken_fast_path import self_check_corpus
from render_service.tokenize.tokenizer import TextTokenizer, TokenizerError
from tests.shared_paths import QWEN3_FIXTURE_DIR

QWEN3_DIR = QWEN3_FIXTURE_DIR
QWEN3_TOKENIZER = QWEN3_DIR / "tokenizer.json"
QWEN3_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
SIMPLE_REGEX = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"


@pytest.fixture(scope="module")
def proof_cache(tmp_path_factory):
    """A private SPLITSERVE_CACHE, so the merge proof really runs in this module."""
    cache = tmp_path_factory.mktemp("splitserve-cache")
    old = os.environ.get("SPLITSERVE_CACHE")
    os.environ["SPLITSERVE_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("SPLITSERVE_CACHE", None)
    else:
        os.environ["SPLITSERVE_CACHE"] = old


def load_with_backend(path: Path, backend: str) -> TextTokenizer:
    old = os.environ.get("SPLITSERVE_TOKENIZER_BACKEND")
    os.environ["SPLITSERVE_TOKENIZER_BACKEND"] = backend
    try:
        return TextTokenizer.from_file(path)
    finally:
        if old is None:
            os.environ.pop("SPLITSERVE_TOKENIZER_BACKEND", None)
        else:
            os.environ["SPLITSERVE_TOKENIZER_BACKEND"] = old


@pytest.fixture(scope="module", params=["auto", "tiktoken"])
def qwen(proof_cache, request) -> TextTokenizer:
    tok = load_with_backend(QWEN3_TOKENIZER, request.param)
    assert tok.encode_backend == ("fastokens" if request.param == "auto" else "tiktoken"), tok.encode_backend_reason
    return tok


@pytest.fixture(scope="module")
def qwen_reference() -> Tokenizer:
    return Tokenizer.from_file(str(QWEN3_TOKENIZER))


def reference_ids(reference: Tokenizer, text: str) -> list[int]:
    return reference.encode(text, add_special_tokens=False).ids


def tiny_ranks(extra: list[bytes]) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in extra:
        ranks[token] = len(ranks)
    return ranks


TINY_TOKENS = [b"th", b"he", b"the", b" t", b" the", b"in", b"ng", b"ing", b"ab", b"bc", b"abc", b" a"]


def write_tokenizer(tmp_path: Path, spec: dict, name: str = "tokenizer.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path


def tiny_spec(**overrides) -> dict:
    spec = byte_level_bpe_spec(tiny_ranks(TINY_TOKENS), SIMPLE_REGEX, normalizer={"type": "NFC"})
    spec.update(overrides)
    return spec


def added(content: str, token_id: int, **flags) -> dict:
    entry = {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
    entry.update(flags)
    return entry


# --- Qwen3's real tokenizer ----------------------------------------------------------------------------------

def test_qwen3_takes_the_fast_path_after_proving_its_merges(qwen, proof_cache):
    assert qwen.fast_path, qwen.fast_path_reason
    assert qwen.fast_path_reason.startswith("tiktoken")
    assert qwen.sha256 == QWEN3_SHA256
    assert f"{QWEN3_SHA256}.v1.ok" in [p.name for p in (proof_cache / "bpe-proofs").iterdir()]


def test_qwen3_fast_path_equals_tokenizers_on_the_self_check_corpus(qwen, qwen_reference):
    for text in self_check_corpus(qwen.added_token_ids):
        assert qwen.encode(text) == reference_ids(qwen_reference, text), text


def test_added_tokens_are_split_out_before_normalization(qwen, qwen_reference):
    # NFC of ">" + U+0338 is U+226F: normalizing first would destroy the <think> token.
    text = "<think>\u0338x</think>\u0338"
    assert qwen.encode(text) == reference_ids(qwen_reference, text)
    assert qwen.encode(text)[0] == qwen.token_to_id("<think>")


def test_nfc_follows_tokenizers_where_unicode_tables_differ(qwen, qwen_reference):
    # Python's newer Unicode table reorders these marks; tokenizers' older one does not.
    text = "\u0596\U00011a99 and e\u0301"
    assert qwen.encode(text) == reference_ids(qwen_reference, text)


def test_special_tokens_inside_text_become_their_ids(qwen):
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 151644 and 151645 in ids
    assert qwen.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


ADDED_CONTENTS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>", "<|im_"]
TRICKY = ["\u0301", "\u0338", "\u0596", "\U00011a99", "\u0323", "\u200d", "\ufe0f", "'s", "'LL", "\r\n", "  ",
          "\t", "\u3000", "1", "٣", "😀", "👨‍👩‍👧", "\u1100", "\u1161", "\u11a8", "ſ", "\u212a"]
texts = st.lists(
    st.one_of(st.text(max_size=20), st.sampled_from(ADDED_CONTENTS), st.sampled_from(TRICKY),
              st.text(alphabet=st.characters(min_codepoint=0x300, max_codepoint=0x36F), max_size=4)),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_fast_path_equals_tokenizers_on_random_text(qwen, qwen_reference, text):
    assert qwen.encode(text) == reference_ids(qwen_reference, text)


def test_long_nonrepetitive_text_matches(qwen, qwen_reference):
    import random

    rng = random.Random(7)
    words = ["alpha", "βήτα", "гамма", "דלתא", "إبسلون", "ζ", "η", "θ", "漢字", "かな", "한글", "emoji😀", "x=1;"]
    text = " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(3000))
    assert qwen.encode(text) == reference_ids(qwen_reference, text)


@pytest.mark.parametrize("fast", [True, False])
def test_lone_surrogates_are_rejected_on_both_paths(fast, qwen):
    tok = qwen if fast else TextTokenizer(qwen.hf, qwen.special_token_ids, fast=False)
    assert tok.fast_path is fast
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("ok \ud800 not ok")


def test_token_bytes_reassemble_the_utf8_text(qwen):
    text = "Grüße 😀 中文 <think>x</think> \u0301"
    ids = qwen.encode(text)
    assert qwen.is_byte_level
    assert b"".join(qwen.token_bytes(i) for i in ids) == qwen.decode(ids, skip_special_tokens=False).encode()
    assert qwen.token_bytes(qwen.token_to_id("<|im_end|>")) == b"<|im_end|>"
    # One emoji spans several byte tokens, none of them valid UTF-8 alone.
    emoji = qwen.encode("😀")
    assert b"".join(qwen.token_bytes(i) for i in emoji) == "😀".encode()


@pytest.mark.parametrize("bad_id", [-1, 151669, 10**9])
def test_token_bytes_rejects_unknown_ids(qwen, bad_id):
    with pytest.raises(ValueError):
        qwen.token_bytes(bad_id)


def test_token_conversion_matches_transformers_fast_tokenizer(qwen):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(QWEN3_TOKENIZER))
    ids = qwen.encode("Hello wörld 😀 <|im_end|> café\n\tend")
    tokens = qwen.convert_ids_to_tokens(ids)
    assert tokens == hf.convert_ids_to_tokens(ids)
    assert qwen.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
    # Incremental detokenizers convert slices; a partial emoji must come out as HF's replacement text.
    assert qwen.convert_tokens_to_string(tokens[:-3]) == hf.convert_tokens_to_string(tokens[:-3])


def test_convert_ids_to_tokens_rejects_unknown_ids(qwen):
    with pytest.raises(ValueError):
        qwen.convert_ids_to_tokens([1, 10**9])


# --- when the fast path must not be used -----------------------------------------------------------------------

def test_tiny_canonical_tokenizer_takes_the_fast_path(tmp_path, proof_cache):
    path = write_tokenizer(tmp_path, tiny_spec())
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert tok.fast_path, tok.fast_path_reason
    for text in ["the thing", " the abc", "abcabc inging", "tHe 12 ab!"]:
        assert tok.encode(text) == reference_ids(reference, text)


def test_non_canonical_merge_falls_back_and_would_have_differed(tmp_path, proof_cache):
    spec = tiny_spec()
    merges = spec["model"]["merges"]
    index = merges.index(["ab", "c"])
    merges[index] = ["a", "bc"]  # "abc" is listed as a + bc, but BPE reaches ab + c first
    path = write_tokenizer(tmp_path, spec)
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert not tok.fast_path
    assert "split tiktoken would reach" in tok.fast_path_reason
    assert tok.encode("abc") == reference_ids(reference, "abc")
    # Why the proof matters: tiktoken would merge "abc", tokenizers cannot.
    naive = tiktoken.Encoding("naive", pat_str=SIMPLE_REGEX, mergeable_ranks=tiny_ranks(TINY_TOKENS),
                              special_tokens={})
    assert naive.encode_ordinary("abc") != reference_ids(reference, "abc")


def test_merges_out_of_rank_order_fall_back(tmp_path, proof_cache):
    spec = tiny_spec()
    merges = spec["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    tok = TextTokenizer.from_file(write_tokenizer(tmp_path, spec))
    assert not tok.fast_path and "rank order" in tok.fast_path_reason


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_added_token_strip_flags_fall_back(tmp_path, proof_cache, flag):
    spec = tiny_spec(added_tokens=[added("<x>", 268, **{flag: True})])
    path = write_tokenizer(tmp_path, spec)
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert not tok.fast_path and flag in tok.fast_path_reason
    assert tok.encode("a <x> b<x>c") == reference_ids(reference, "a <x> b<x>c")


def test_normalized_added_token_matches_after_nfc(tmp_path, proof_cache):
    # U+01D8 is u + U+0308 + U+0301 composed; a normalized added token is matched on the NFC text.
    spec = tiny_spec(added_tokens=[added("\u01d8", 268, normalized=True, special=False), added("<s>", 269)])
    path = write_tokenizer(tmp_path, spec)
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert tok.fast_path, tok.fast_path_reason
    for text in ["xu\u0308\u0301y", "\u01d8<s>u\u0308\u0301", "<s>\u0308\u0301", "u\u0301\u0308"]:
        assert tok.encode(text) == reference_ids(reference, text), text
    assert tok.encode("xu\u0308\u0301y") == [ord("x"), 268, ord("y")]


def test_added_token_already_in_the_vocab_keeps_the_vocab_id(tmp_path, proof_cache):
    # "é" is also the byte-level spelling of byte 0xE9 (ID 233): tokenizers uses 233, not the file's 268.
    spec = tiny_spec(added_tokens=[added("é", 268, special=False), added("<s>", 269)])
    path = write_tokenizer(tmp_path, spec)
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert tok.fast_path, tok.fast_path_reason
    for text in ["café <s>", "é<s>é"]:
        assert tok.encode(text) == reference_ids(reference, text), text
    assert tok.encode("é") == [233]


def test_no_normalizer_keeps_decomposed_text(tmp_path, proof_cache):
    path = write_tokenizer(tmp_path, tiny_spec(normalizer=None))
    tok = TextTokenizer.from_file(path)
    reference = Tokenizer.from_file(str(path))
    assert tok.fast_path, tok.fast_path_reason
    assert tok.encode("e\u0301") == reference_ids(reference, "e\u0301") == list("e\u0301".encode())


def test_other_normalizers_fall_back(tmp_path, proof_cache):
    path = write_tokenizer(tmp_path, tiny_spec(normalizer={"type": "Lowercase"}))
    tok = TextTokenizer.from_file(path)
    assert not tok.fast_path and "Lowercase" in tok.fast_path_reason
    assert tok.encode("THE") == reference_ids(Tokenizer.from_file(str(path)), "THE")


def test_truncation_in_the_file_never_shortens_encode(tmp_path, proof_cache):
    spec = tiny_spec(truncation={"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0})
    for fast in (True, False):
        tok = TextTokenizer.from_file(write_tokenizer(tmp_path, spec), fast=fast)
        assert len(tok.encode("the thing is a long sentence")) > 3


def test_fast_path_can_be_disabled(tmp_path, proof_cache):
    tok = TextTokenizer.from_file(write_tokenizer(tmp_path, tiny_spec()), fast=False)
    assert not tok.fast_path and "disabled" in tok.fast_path_reason
    assert tok.encode("the") == [258]


def test_non_byte_level_tokenizer_has_no_token_bytes(tmp_path):
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    word_level = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    word_level.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    word_level.save(str(path))
    tok = TextTokenizer.from_file(path)
    assert not tok.fast_path and not tok.is_byte_level
    assert tok.encode("hello world") == [1, 2]
    with pytest.raises(TypeError):
        tok.token_bytes(1)


@pytest.mark.parametrize("content", [b"", b"{", b"[1, 2]", b'{"model": {"type": "BPE", "vocab": 3}}', b"\xff\xfe"])
def test_invalid_tokenizer_json_raises_tokenizer_error(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError):
        TextTokenizer.from_file(path)


def test_missing_file_raises_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError):
        TextTokenizer.from_file(tmp_path / "nope.json")
