"""The tiktoken fast path and its proof: when a tokenizer.json is byte-level BPE in exactly the shape tiktoken
runs (merges are the ranks, one split regex, NFC or no normalizer, plain added tokens), an encoder built on
tiktoken from the same vocabulary gives the same IDs, several times faster. The equivalence is proved from
the file's structure (the merge proof is remembered per file hash under the cache) and then checked on a
self-check corpus by the caller."""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from render_service.tokenize.byte_level import lower_rank_split, token_string_to_bytes
from splitserve_common.cache_dir import cache_root

# --- the fast path: proof from the file's structure ------------------------------------------------------

class NotProvable(Exception):
    """The tokenizer.json is outside the shape whose tiktoken equivalence we can prove."""


def _normalizer_is_nfc(spec: dict[str, Any]) -> bool:
    """True for NFC, False for no normalizer; anything else is not provable."""
    normalizer = spec.get("normalizer")
    if normalizer is None:
        return False
    kind = normalizer.get("type")
    if kind == "Sequence":
        steps = normalizer.get("normalizers") or []
        if len(steps) > 1:
            raise NotProvable("normalizer Sequence with several steps")
        return _normalizer_is_nfc({"normalizer": steps[0]}) if steps else False
    if kind == "NFC":
        return True
    raise NotProvable(f"normalizer {kind}")


def _split_regex(spec: dict[str, Any]) -> str:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or len(steps) != 2:
        raise NotProvable("pre_tokenizer is not Split + ByteLevel")
    split, byte_level = steps
    if split.get("type") != "Split" or "Regex" not in (split.get("pattern") or {}):
        raise NotProvable("first pre_tokenizer step is not a regex Split")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise NotProvable("Split behaviour is not Isolated")
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True):
        raise NotProvable("second pre_tokenizer step is not ByteLevel(use_regex=false)")
    if byte_level.get("add_prefix_space"):
        raise NotProvable("ByteLevel adds a prefix space")
    pattern: str = split["pattern"]["Regex"]
    return pattern


def _check_bpe_model(model: dict[str, Any]) -> None:
    if model.get("type") != "BPE":
        raise NotProvable(f"model {model.get('type')}")
    if model.get("dropout") or model.get("byte_fallback"):
        raise NotProvable("BPE dropout or byte_fallback")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise NotProvable("BPE subword prefix/suffix")


def _check_ranks(ranks: dict[bytes, int] | None) -> dict[bytes, int]:
    if ranks is None:
        raise NotProvable("vocab is not byte-level")
    if len(set(ranks.values())) != len(ranks):
        raise NotProvable("vocab has duplicate IDs")
    if sum(1 for raw in ranks if len(raw) == 1) != 256:
        raise NotProvable("vocab lacks some single bytes")
    return ranks


def _merge_strings(merges: list[Any]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if len(pair) != 2:
            raise NotProvable("a merge is not a pair")
        pairs.append((pair[0], pair[1]))
    return pairs


def _check_merges_follow_ranks(pairs: list[tuple[str, str]], vocab: dict[str, int]) -> None:
    """Each merge builds a vocab token; merge order is rank order; one merge per multi-byte token.

    Byte-level spelling is per byte, so concatenating spellings is concatenating bytes.
    """
    if len(pairs) != len(vocab) - 256:
        raise NotProvable("merge count differs from the number of multi-byte tokens")
    previous = -1
    for a, b in pairs:
        rank = vocab.get(a + b)
        if rank is None or rank <= previous or vocab.get(a, rank) >= rank or vocab.get(b, rank) >= rank:
            raise NotProvable("merges are not in the rank order of the tokens they build")
        previous = rank


def _check_merges_are_lower_rank_splits(pairs: list[tuple[str, str]], ranks: dict[bytes, int]) -> None:
    """The one merge of each token is the split tiktoken's BPE reaches: then both libraries merge alike."""
    for a, b in pairs:
        left, right = token_string_to_bytes(a), token_string_to_bytes(b)
        if left is None or right is None:
            raise NotProvable(f"merge {a!r} + {b!r} is not byte-level")
        token = left + right
        if lower_rank_split(token, ranks[token], ranks) != [left, right]:
            raise NotProvable(f"merge {a!r} + {b!r} is not the split tiktoken would reach")


def _added_tokens(hf: Tokenizer) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens matched on raw text, tokens matched on normalized text), content -> id.

    Read from the loaded tokenizer, not the file: tokenizers gives an added token whose content is
    already in the vocabulary that vocabulary ID, whatever ID the file states.
    """
    raw: dict[str, int] = {}
    normalized: dict[str, int] = {}
    for token_id, token in hf.get_added_tokens_decoder().items():
        if token.lstrip or token.rstrip or token.single_word:
            raise NotProvable(f"added token {token.content!r} has lstrip/rstrip/single_word")
        if token.content:
            (normalized if token.normalized else raw)[token.content] = token_id
    return raw, normalized


# Bump when the merge proof checks something new: markers of an older proof then no longer count.
MERGE_PROOF_VERSION = 1


def _proof_marker(sha256: str) -> Path:
    return cache_root() / "bpe-proofs" / f"{sha256}.v{MERGE_PROOF_VERSION}.ok"


def remember_merge_proof(sha256: str) -> None:
    """Records that the tokenizer.json with this hash passed the merge proof (or was built to pass it)."""
    marker = _proof_marker(sha256)
    # Best effort: without a writable cache the next load just proves again.
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
        tmp.write_text("every merge is the lower-rank split of the token it builds\n")
        os.replace(tmp, marker)
    except OSError:
        pass


# --- the fast path: the encoder --------------------------------------------------------------------------

class AddedTokenSplitter:
    """Cuts text at added tokens the way ``tokenizers`` does (leftmost, then longest, before anything else)."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self._ids = tokens
        longest_first = sorted(tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if tokens else None

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yields (segment, None) for plain text and (content, id) for each added token."""
        if self._pattern is None:
            if text:
                yield text, None
            return
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                yield text[start:match.start()], None
            yield match.group(), self._ids[match.group()]
            start = match.end()
        if start < len(text):
            yield text[start:], None


class NfcLikeTokenizers:
    """NFC exactly as ``tokenizers`` computes it, fast on text that is already normalized.

    ``tokenizers`` normalizes with an old Unicode table, Python with a newer one, so they disagree on
    some marks assigned since (U+0596 U+11A99 is reordered by Python only). Normalization stability
    makes a text Python finds NFC also NFC for the older table; any other text goes to ``tokenizers``' own
    normalizer, which is exact but ~40x slower.
    """

    def __init__(self, hf_normalizer: Any) -> None:
        self._hf_normalize = hf_normalizer.normalize_str

    def __call__(self, text: str) -> str:
        if text.isascii() or unicodedata.is_normalized("NFC", text):
            return text
        normalized: str = self._hf_normalize(text)
        return normalized


class TiktokenEncoder:
    """HF's encode pipeline on tiktoken: added tokens out first, then normalize, regex split, byte BPE."""

    def __init__(self, encoding: Any, raw_added: dict[str, int], normalized_added: dict[str, int],
                 normalize: Callable[[str], str] | None = None) -> None:
        self._encode_ordinary = encoding.encode_ordinary
        self._raw = AddedTokenSplitter(raw_added)
        self._normalized = AddedTokenSplitter(normalized_added)
        self._normalize = normalize

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for segment, added_id in self._raw.split(text):
            if added_id is not None:
                ids.append(added_id)
            else:
                ids.extend(self.encode_segment(segment))
        return ids

    def encode_segment(self, segment: str) -> list[int]:
        """The ids of text that holds no raw-matched added token (a piece ``encode`` cuts out)."""
        if self._normalize is not None:
            segment = self._normalize(segment)
        ids: list[int] = []
        for piece, piece_id in self._normalized.split(segment):
            if piece_id is not None:
                ids.append(piece_id)
            else:
                ids.extend(self._encode_ordinary(piece))
        return ids


def _prove_merges_are_ranks(merges: list[Any], vocab: dict[str, int], ranks: dict[bytes, int]) -> None:
    pairs = _merge_strings(merges)
    _check_merges_follow_ranks(pairs, vocab)
    _check_merges_are_lower_rank_splits(pairs, ranks)


def build_tiktoken_encoder(spec: dict[str, Any], hf: Tokenizer, ranks: dict[bytes, int] | None,
                           load_merges: Callable[[], list[Any]], sha256: str | None = None) -> TiktokenEncoder:
    """A TiktokenEncoder proved equivalent to ``hf`` on ``spec``; raises NotProvable otherwise.

    The merge proof is the slow part (~2 s for 151k tokens, and the merges must be parsed): it is
    remembered per tokenizer.json hash, so later loads of the same file skip it.
    """
    import tiktoken

    nfc = _normalizer_is_nfc(spec)
    pattern = _split_regex(spec)
    model = spec.get("model") or {}
    _check_bpe_model(model)
    ranks = _check_ranks(ranks)
    raw_added, normalized_added = _added_tokens(hf)
    if not (sha256 and _proof_marker(sha256).exists()):
        _prove_merges_are_ranks(load_merges(), model.get("vocab") or {}, ranks)
        if sha256:
            remember_merge_proof(sha256)
    try:
        encoding = tiktoken.Encoding("splitserve-fast-path", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={})
    except ValueError as exc:  # the Oniguruma pattern does not compile in tiktoken's regex engine
        raise NotProvable(f"tiktoken rejects the split regex: {exc}") from exc
    normalize = NfcLikeTokenizers(hf.normalizer) if nfc else None
    return TiktokenEncoder(encoding, raw_added, normalized_added, normalize)


# --- the self-check corpus ---------------------------------------------------------------------------------

def self_check_corpus(added_tokens: Iterable[str] = ()) -> list[str]:
    """Texts on which the fast path must equal ``tokenizers`` before it is trusted."""
    import random

    texts = [
        "Hello, world! How's it going? I'M fine, they'VE said; we'd've LL.",
        "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D 'ſ 'K 'ﬅ",  # case-folded contractions
        "Grüße aus Köln — naïve café, façade, Ångström, ÆØÅ æøå ß ẞ",
        "Привет, мир! Ελληνικά κείμενα. עברית שלום. العربية مرحبا. हिन्दी नमस्ते। ไทย สวัสดี",
        "中文测试：你好，世界！日本語のテキスト、カタカナ。한국어 텍스트입니다.",
        "Emoji 😀👍🏽👨‍👩‍👧‍👦🏳️‍🌈 🇩🇪🇯🇵 ❤️‍🔥 1️⃣ ©️ ™",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x >= 10**9:\n\t\tpass\r\n",
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        "x" * 300 + " " + "ab" * 200 + " " + "!?" * 150,
        "   leading and trailing   \n\n\n  \t\t \u00a0\u3000 \u2003 end   ",
        "\r\n\r\n\n \n\t\n   \n",
        "Numbers 1234567890 3.14159 1,000,000 ٠١٢٣٤٥ ½ ² Ⅻ ①②③ 𝟘𝟙𝟚",
        # Decomposed input that NFC must compose, and marks Python's newer table orders differently.
        "combining e\u0301 a\u0308 o\u0302\u0323 A\u030a \u1100\u1161\u11a8 \u212b \u2126 \u212a",
        "\u0596\U00011a99 a\u0596\U00011a99\u0301 \U00011a99\u0596",
        "<think>\u0338 >\u0338 <\u0338 =\u0338",  # a combining mark right after an added token
        "ZWJ\u200dZWNJ\u200cBOM\ufeffLRM\u200eRLM\u200f SHY\u00ad",
        "control \x00\x01\x07\x1b[31m\x7f\x85 end",
        # Every White_Space character between letters and digits (regex engines disagree on some).
        "".join(f"a{c}b{c}1{c}{c}\n" for c in "\t\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u180e\u2000\u2001"
                "\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u200b\u2028\u2029\u202f\u205f"
                "\u3000\ufeff"),
        "Mixed123abc ABC123 a1b2c3 __init__ self.x_y camelCase snake_case kebab-case",
        "URLs https://example.com/a?b=c&d=e#f and emails someone@example.org",
    ]
    for token in added_tokens:
        texts.append(f"a{token}b {token} {token}{token}\n{token}x\u0301 {token[:-1]} {token}\u0338")
    rng = random.Random(0x5EED)
    pools = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF),
             (0x1100, 0x11FF), (0x1DC0, 0x1DFF), (0x2000, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF),
             (0xAC00, 0xD7A3), (0xFB00, 0xFFFD), (0x1F300, 0x1FAFF), (0x10000, 0x1FFFF), (0x20000, 0x2A6DF),
             (0xE0000, 0xE01EF)]
    for _ in range(6):
        chars = []
        for _ in range(400):
            low, high = rng.choice(pools)
            chars.append(chr(rng.randint(low, high)))
            if rng.random() < 0.15:
                chars.append(rng.choice([" ", "  ", "\n", "\t", " \n", "'s", "'LL", "0", "12"]))
        texts.append("".join(chars))
    return texts
