"""Incremental prompt tokenization: ids identical to ``tokenizers`` (and, through render, to transformers'
apply_chat_template) on every chunking, cache hit or miss; pieces cut only where independence is proved."""

from __future__ import annotations

import array
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from render_service.tokenize.incremental_tokenizer import (
    TAIL_SEARCH_CHARS,
    IncrementalEncoder,
    PromptIds,
    SegmentCache,
    independence_violation,
)
from render_service.tokenize.tokenizer import TextTokenizer
from tests.shared_paths import QWEN3_FIXTURE_DIR

QWEN3_TOKENIZER = QWEN3_FIXTURE_DIR / "tokenizer.json"
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def qwen_fast() -> TextTokenizer:
    tok = TextTokenizer.from_file(QWEN3_TOKENIZER)
    assert tok.fast_path
    return tok


@pytest.fixture(scope="module")
def qwen_hf() -> TextTokenizer:
    tok = TextTokenizer.from_file(QWEN3_TOKENIZER, fast=False)
    assert not tok.fast_path
    return tok


def _wrap(tokenizer: Tokenizer) -> TextTokenizer:
    return TextTokenizer.from_bytes(tokenizer.to_str().encode("utf-8"), fast=False)


def _word_vocab() -> dict[str, int]:
    words = ["[UNK]", "a", "b", "c", "ab", "abc", "the", "▁", "▁a", "▁the", "▁b", "hello", "##b", "##c", "x", "é"]
    return {w: i for i, w in enumerate(words)}


@pytest.fixture(scope="module")
def gpt2_style() -> TextTokenizer:
    """Byte-level BPE that adds a prefix space to every piece (GPT-2 / RoBERTa style)."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|sep|>", special=True, normalized=False)])
    return _wrap(tok)


@pytest.fixture(scope="module")
def bert_style() -> TextTokenizer:
    """WordPiece under BERT's normalizer (lowercase, accents stripped) and pre-tokenizer."""
    tok = Tokenizer(models.WordPiece(vocab=_word_vocab(), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens([AddedToken("[SEP]", special=True, normalized=False)])
    return _wrap(tok)


def _metaspace(scheme: str) -> TextTokenizer:
    tok = Tokenizer(models.WordLevel(vocab=_word_vocab(), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return _wrap(tok)


def ref(tokenizer: TextTokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------------------------- text

ADDED = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
         "</tool_response>", "<|endoftext|>"]
EDGES = ["\u0338", "e\u0301", "\u0301", "\u1100\u1161\u11a8", "\u0390", "\u03b9\u0308\u0301", "\r\n", "\n\n\n",
         "  ", "\t", "\u00a0", "\u200d", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "'s", "'LL", "123456", "\ufeff",
         "\U00011a99\u0596", "<", ">", "<|", "|>", "<think", "think>", "ﬅ", "İ", "ß"]
fragments = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
    st.sampled_from(ADDED),
    st.sampled_from(EDGES),
    st.text(alphabet="ab <>|/\n", max_size=12),
)
texts = st.lists(fragments, max_size=14).map("".join)


# --------------------------------------------------------------------------------------- equality

@PROPERTY
@given(parts=st.lists(texts, min_size=1, max_size=5))
def test_qwen_fast_path_equals_tokenizers_on_every_chunking(qwen_fast, parts):
    """A conversation grown piece by piece through one cache: every prefix, miss then hit, equals tokenizers."""
    encoder = IncrementalEncoder(qwen_fast, 1 << 20)
    assert encoder.enabled
    text = ""
    for part in parts:
        text += part
        expected = ref(qwen_fast, text)
        assert encoder.encode(text) == expected
        assert encoder.encode(text) == expected  # every piece a hit now


@PROPERTY
@given(parts=st.lists(texts, min_size=1, max_size=4))
def test_qwen_tokenizers_path_equals_tokenizers_on_every_chunking(qwen_hf, parts):
    encoder = IncrementalEncoder(qwen_hf, 1 << 20)
    text = ""
    for part in parts:
        text += part
        assert encoder.encode(text) == ref(qwen_hf, text)


@PROPERTY
@given(texts=st.lists(texts, min_size=2, max_size=6))
def test_one_cache_shared_by_unrelated_texts_stays_exact(qwen_fast, texts):
    encoder = IncrementalEncoder(qwen_fast, 4096)  # small: entries are evicted between texts
    for text in texts + texts[::-1]:
        assert encoder.encode(text) == ref(qwen_fast, text)


@pytest.mark.parametrize("kind", ["gpt2_style", "bert_style"])
@PROPERTY
@given(data=st.data())
def test_other_pipelines_proved_independent_equal_tokenizers(request, kind, data):
    tokenizer = request.getfixturevalue(kind)
    sep = "<|sep|>" if kind == "gpt2_style" else "[SEP]"
    pieces = data.draw(st.lists(st.one_of(texts, st.just(sep), st.sampled_from(["Hello ", " the", "ÉAB c", "x"])),
                                max_size=10))
    encoder = IncrementalEncoder(tokenizer, 1 << 20)
    assert encoder.enabled, encoder.reason
    text = "".join(pieces)
    assert encoder.encode(text) == ref(tokenizer, text)
    assert encoder.encode(text) == ref(tokenizer, text)


def test_nfc_composition_stops_at_added_tokens_as_in_tokenizers(qwen_fast, qwen_hf):
    """'>' + U+0338 composes to U+226F under NFC; after an added token the mark starts a new piece in both."""
    text = "<think>\u0338 a>\u0338 </think>\u0338<|im_end|>e\u0301"
    for tokenizer in (qwen_fast, qwen_hf):
        assert IncrementalEncoder(tokenizer).encode(text) == ref(tokenizer, text)
    assert unicodedata.normalize("NFC", ">\u0338") == "\u226f"


# -------------------------------------------------------------------------------- the proof's refusals

def test_metaspace_first_is_refused_and_cutting_would_be_wrong():
    """prepend_scheme 'first' treats the piece at offset 0 alone: cut pieces would each get the ▁."""
    first = _metaspace("first")
    assert "prepend_scheme: first" in independence_violation(first)
    encoder = IncrementalEncoder(first)
    assert not encoder.enabled
    text = "the<s>the"
    naive = ref(first, "the") + [first.hf.token_to_id("<s>")] + ref(first, "the")
    assert naive != ref(first, text)  # why the proof matters
    assert encoder.encode(text) == ref(first, text)
    always = _metaspace("always")
    assert independence_violation(always) is None
    assert IncrementalEncoder(always).encode(text) == ref(always, text)


def test_added_token_that_strips_whitespace_is_refused_and_cutting_would_be_wrong():
    tok = Tokenizer(models.WordLevel(vocab=_word_vocab(), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False, lstrip=True)])
    stripping = _wrap(tok)
    assert "strips whitespace" in independence_violation(stripping)
    assert not IncrementalEncoder(stripping).enabled


def test_cache_off_is_the_tokenizers_own_encode(qwen_fast):
    encoder = IncrementalEncoder(qwen_fast, 0)
    assert not encoder.enabled and "off" in encoder.reason
    assert encoder.encode("<|im_start|>user\nhi<|im_end|>") == ref(qwen_fast, "<|im_start|>user\nhi<|im_end|>")
    assert len(encoder.cache) == 0


# ------------------------------------------------------------------------------------------- the cache

def test_cache_stays_under_its_byte_bound_and_drops_least_recent_first():
    cache = SegmentCache(16000)
    for i in range(200):
        cache.put(f"piece {i} " * 5, tuple(range(20)), b"")
        assert cache.bytes <= cache.max_bytes
    assert cache.evictions > 0
    assert cache.get("piece 0 " * 5) is None  # the oldest went first
    assert cache.get("piece 199 " * 5) == (tuple(range(20)), b"")


def test_cache_skips_a_piece_too_large_to_share_the_cache():
    cache = SegmentCache(8000)
    cache.put("small", (1,), b"1")
    cache.put("x" * 5000, (2,) * 10, b"")  # over an eighth of the cache
    assert cache.get("x" * 5000) is None and cache.get("small") == ((1,), b"1")


def test_cached_ids_give_the_garbage_collector_no_id_to_walk(qwen_fast):
    import gc

    encoder = IncrementalEncoder(qwen_fast)
    encoder.encode("<|im_start|>user\nsome words here<|im_end|>\n")
    gc.collect()
    kept = [ids for (ids, _), _ in encoder.cache._entries.values()]
    assert kept and all(type(ids) is array.array for ids in kept)  # (fastokens' batch: 4 bytes an id)
    # A collection visits each piece as one object that refers to its type alone, never to an id.
    assert all(gc.get_referents(ids) == [array.array] for ids in kept)


def test_prompt_ids_write_the_same_json_as_plain_ints(qwen_fast):
    import msgspec

    encoder = IncrementalEncoder(qwen_fast)
    text = "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\n<tool_response>\nx y z\n</tool_response><|im_end|>"
    for _ in range(2):  # miss, then hit
        ids = encoder.encode_ids(text)
        assert isinstance(ids, PromptIds)
        assert bytes(ids.json_array()) == msgspec.json.encode(ref(qwen_fast, text))
        assert len(ids) == len(ref(qwen_fast, text)) and ids == ref(qwen_fast, text)


def test_prompt_ids_view_reads_like_the_list_it_stands_for(qwen_fast):
    encoder = IncrementalEncoder(qwen_fast)
    text = ("<|im_start|>system\nYou help.<|im_end|>\n<|im_start|>user\n<tool_response>\n" + "lines of output " * 40
            + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    want = ref(qwen_fast, text)
    for _ in range(2):  # miss, then hit
        ids = encoder.encode_ids(text)
        assert isinstance(ids, PromptIds) and len(ids.chunks) > 5
        assert len(ids) == len(want) and list(ids) == want
        for n in (1, 2, 3, 7, 63, len(want) - 1, len(want)):  # tails inside the last piece and across pieces
            assert ids[-n:] == want[-n:]
        assert ids[0] == want[0] and ids[-1] == want[-1] and ids[5:9] == want[5:9] and ids[::3] == want[::3]
        assert ids == want and ids.tolist() == want and ids.tolist() is ids.tolist()
        assert list(ids) == want  # (iterated again once the list is built)


@pytest.mark.parametrize("text", ["plain words, one piece", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"])
@pytest.mark.parametrize("request_id", [None, 'chatcmpl-x", "token_ids":[1,2]', "\"token_ids\":["])
def test_the_render_response_writes_view_ids_as_plain_ints(qwen_fast, text, request_id):
    """server._encode_generate_request joins the pieces' JSON into the response: the bytes msgspec writes for
    the same request with a plain list, whatever the request id holds."""
    import msgspec

    from render_service.http.server import _encode_generate_request
    from render_service.wire.protocol import GenerateRequest, SamplingParams

    ids = IncrementalEncoder(qwen_fast).encode_ids(text)
    assert isinstance(ids, PromptIds)
    gen = GenerateRequest(request_id=request_id, token_ids=ids, sampling_params=SamplingParams(max_tokens=5),
                          parse_context={"tools": None, "token_ids": [7]})
    plain = msgspec.structs.replace(gen, token_ids=ref(qwen_fast, text))
    assert _encode_generate_request(gen) == msgspec.json.encode(plain)


def test_hits_and_misses_are_counted_in_tokens(qwen_fast):
    encoder = IncrementalEncoder(qwen_fast)
    text = "<|im_start|>user\nsome words here<|im_end|>\n"
    n = len(ref(qwen_fast, text))
    encoder.encode(text)
    hit, miss = encoder.take_counts()
    assert hit + miss == n and miss > 0
    encoder.encode(text)
    assert encoder.take_counts() == (n, 0)


def test_lone_surrogates_are_refused_as_the_tokenizer_refuses_them(qwen_fast):
    """Only new pieces are checked (a hit passed the check once); the error still names the index in the whole
    prompt, as the tokenizer's own encode does."""
    encoder = IncrementalEncoder(qwen_fast)
    good = "<|im_start|>user\nhé, ok<|im_end|>\n"
    encoder.encode(good)
    for bad in (good + "<|im_start|>user\nx \ud800 y<|im_end|>", "\udc00" + good, good + "é\ud83d"):
        with pytest.raises(ValueError) as ours:
            encoder.encode(bad)
        with pytest.raises(ValueError) as theirs:
            qwen_fast.encode(bad)
        assert str(ours.value) == str(theirs.value)
    assert encoder.encode(good) == ref(qwen_fast, good)


# --------------------------------------------------------------------------- the length bound (no tokenizing)

@PROPERTY
@given(text=texts)
def test_min_tokens_never_exceeds_the_real_count(qwen_fast, text):
    assert qwen_fast.min_tokens(text) <= len(ref(qwen_fast, text))


def test_min_tokens_bounds_long_runs_and_decomposed_text(qwen_fast):
    for text in ("a" * 100_000, " " * 50_000, "=" * 70_000, "\u03b9\u0308\u0301" * 20_000,
                 "\u1100\u1161\u11a8" * 20_000, "x\u0301" * 30_000):
        bound = qwen_fast.min_tokens(text)
        assert 0 < bound <= len(ref(qwen_fast, text))


def test_two_render_lanes_share_one_cache_safely(qwen_fast):
    """The interactive and bulk lanes encode at once through one small, evicting cache."""
    import threading

    encoder = IncrementalEncoder(qwen_fast, 6000)
    texts = [f"<|im_start|>user\nquestion {i} {'words ' * (i % 7)}<|im_end|>\n<tool_response>\nr{i}\n</tool_response>"
             for i in range(40)]
    expected = [ref(qwen_fast, t) for t in texts]
    failures: list[int] = []

    def lane(offset: int) -> None:
        for round_no in range(30):
            i = (round_no * 7 + offset) % len(texts)
            if encoder.encode(texts[i]) != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and encoder.cache.evictions > 0
    assert encoder.cache.bytes <= encoder.cache.max_bytes


# ------------------------------------------------------------------------------------ tail of a prompt

@PROPERTY
@given(text=texts, at=st.floats(0, 1))
def test_tail_ids_are_the_whole_encodings_last_ids(qwen_fast, text, at):
    encoder = IncrementalEncoder(qwen_fast)
    before = int(at * len(text))
    tail = encoder.tail_ids(text, before)
    if tail is None:
        return
    whole = ref(qwen_fast, text)
    assert whole[len(whole) - len(tail):] == tail
    # ... those of the text from an added token at or before ``before`` on.
    token = qwen_fast.id_to_token(tail[0])
    assert any(ref(qwen_fast, text[p:]) == tail for p in range(before, -1, -1) if text.startswith(token, p))


def test_tail_ids_start_at_the_last_added_token_before_the_position(qwen_fast):
    encoder = IncrementalEncoder(qwen_fast)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThree cats."
    tail = encoder.tail_ids(text, len(text) - 3)
    assert tail == ref(qwen_fast, "<|im_start|>assistant\nThree cats.")


def test_tail_ids_of_a_window_are_the_whole_texts_last_ids(qwen_fast):
    """A window (the end of a longer text) with ``cut_context_chars`` of context before ``floor``: the ids are the
    whole text's last ones, and no cut is taken before ``floor``, where the window cannot prove one."""
    encoder = IncrementalEncoder(qwen_fast)
    turns = "".join(f"<|im_start|>user\nturn {i} about cats<|im_end|>\n<|im_start|>assistant\nfine {i}<|im_end|>\n"
                    for i in range(6))
    text = turns + "<|im_start|>user\nthe last one<|im_end|>\n<|im_start|>assistant\n"
    whole = ref(qwen_fast, text)
    start = text.index("<|im_start|>user\nturn 4") - encoder.cut_context_chars
    window, floor = text[start:], encoder.cut_context_chars
    before = len(window) - 5
    tail = encoder.tail_ids(window, before, floor)
    assert tail is not None and whole[len(whole) - len(tail):] == tail
    assert tail == encoder.tail_ids(text, start + before)
    # A floor past every added token before ``before``: no cut the window may take.
    last = window.rindex("<|im_start|>")
    assert encoder.tail_ids(window, last - 1, last) is None


def test_a_proved_cut_splits_the_encoding_and_a_part_is_not_filed_as_a_prompt(qwen_fast):
    """``cuts_at``: wherever it says the tokenizer cuts, the encoding is the two sides' encodings; it says so at
    an added token's start and end (with the context before it), and never before ``floor``. ``encode_part``
    gives ``encode``'s ids without filing the text among the prompts' prefixes."""
    encoder = IncrementalEncoder(qwen_fast)
    text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>\n\nHello!<|im_end|>\nx"
    proved = [at for at in range(len(text) + 1) if encoder.cuts_at(text, at)]
    for at in proved:
        assert ref(qwen_fast, text) == ref(qwen_fast, text[:at]) + ref(qwen_fast, text[at:]), at
    end = text.index("<|im_end|>") + len("<|im_end|>")
    assert {0, text.index("<|im_end|>"), end, text.index("<|im_start|>assistant")} <= set(proved)
    assert not encoder.cuts_at(text, end, floor=end + 1)
    assert not encoder.cuts_at(text, text.index("hi") + 1)  # (inside a word: not an added token's edge)
    long_text = text * 40  # (long enough to be filed as a prompt)
    assert encoder.prefixes is not None
    assert encoder.encode_part(long_text) == ref(qwen_fast, long_text)
    assert encoder.prefixes.find(long_text) is None
    encoder.encode(long_text)
    assert encoder.prefixes.find(long_text) is not None


def test_tail_ids_never_cut_inside_a_longer_added_token():
    """``<<x>`` holds ``<x>``: a search window that starts inside ``<<x>`` finds ``<x>`` alone, where the tokenizer
    cuts ``<<x>`` whole. Cutting at ``<x>`` would give other ids; the cut is refused."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<<x>", special=True, normalized=False),
                            AddedToken("<x>", special=True, normalized=False)])
    wrapped = _wrap(tok)
    encoder = IncrementalEncoder(wrapped)
    assert encoder.enabled, encoder.reason
    text = "aa<<x>" + "b" * TAIL_SEARCH_CHARS
    before = 3 + TAIL_SEARCH_CHARS  # the search starts at 3, inside "<<x>"
    assert ref(wrapped, text)[2] == tok.token_to_id("<<x>")
    assert encoder.tail_ids(text, before) is None
    assert encoder.tail_ids(text, before - 1) == ref(wrapped, text)[2:]  # a window that holds "<<x>" cuts there
