"""Text <-> token IDs for the render tier.

Hugging Face ``tokenizers`` is the reference. Two faster paths give the same IDs:
- fastokens (``fastokens_path``), for any tokenizer.json it equals ``tokenizers`` on at load: the fastest;
- tiktoken, when a tokenizer.json is byte-level BPE in exactly the shape tiktoken runs (merges are the ranks,
  one split regex, NFC or no normalizer, plain added tokens): an ``Encoding`` built from the same vocabulary.
  That equivalence is proved from the file's structure and then checked on a self-check corpus at load time.
``encode`` takes the first of fastokens, tiktoken, ``tokenizers`` that qualifies (``encode_backend`` and
``encode_backend_reason`` say which and why; ``SPLITSERVE_TOKENIZER_BACKEND`` narrows the choice).
``fast_path`` / ``fast_path_reason`` say whether tiktoken's path exists (``encode_ordinary`` needs it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
from tokenizers import Tokenizer

from render_service.tokenize.byte_level import byte_level_ranks, token_string_to_bytes
from render_service.tokenize.fastokens_path import FastokensEncoder, FastokensUnavailable, chosen_backend
from render_service.tokenize.tiktoken_fast_path import (
    NotProvable,
    TiktokenEncoder,
    build_tiktoken_encoder,
    self_check_corpus,
)
from render_service.tokenize.tokenizer_json import read_merges, read_tokenizer_spec


class RenderTokenizer(Protocol):
    """What render, derender and the parsers rely on (``TextTokenizer`` is the implementation)."""

    hf: Tokenizer  # the ``tokenizers`` object underneath (the detokenizer's tables read its decoder)
    vocab_size: int
    special_token_ids: set[int]
    is_byte_level: bool

    def encode(self, text: str) -> list[int]: ...

    def min_tokens(self, text: str) -> int: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...


# Texts longer than this are tokenized with the GIL released (a render thread then leaves the event loop free).
GIL_FREE_ENCODE_CHARS = 64 * 1024


class TokenizerError(ValueError):
    """The tokenizer file cannot be loaded."""


# --- the interface the render tier uses ---------------------------------------------------------------------

class TextTokenizer:
    """The tokenizer interface the rest of the render tier uses."""

    def __init__(self, hf: Tokenizer, special_token_ids: set[int], *, spec: dict[str, Any] | None = None,
                 load_merges: Callable[[], list[Any]] | None = None, sha256: str | None = None,
                 fast: bool = True, data: bytes | None = None) -> None:
        """``data``: the tokenizer.json's bytes (fastokens is built from them; without them it is not tried)."""
        # Truncation or padding set in a tokenizer.json would silently change encode; the render tier
        # checks lengths itself.
        hf.no_truncation()
        hf.no_padding()
        self.hf = hf
        self.special_token_ids = special_token_ids
        # tokenizer_config's response_template, where the checkpoint describes its reply (the hf/beam parsers
        # read it off the tokenizer, as upstream's do); set by the bundle loader
        self.response_template: dict[str, Any] | None = None
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.sha256 = sha256
        added = hf.get_added_tokens_decoder()
        self.added_token_ids: dict[str, int] = {tok.content: i for i, tok in added.items()}
        self._added_content: dict[int, bytes] = {i: tok.content.encode("utf-8") for i, tok in added.items()}
        model = (spec or {}).get("model") or {}
        # Added tokens are decoded from their content, never through the byte map, so a model vocab that also
        # lists them in plain spelling (DeepSeek's <｜begin▁of▁sentence｜>) is still byte-level for the rest.
        vocab = dict(model.get("vocab") or {})
        for content in self.added_token_ids:
            if content in vocab and token_string_to_bytes(content) is None:
                del vocab[content]
        ranks = byte_level_ranks(vocab) if model.get("type") == "BPE" else None
        self.is_byte_level = bool(ranks) and ((spec or {}).get("decoder") or {}).get("type") == "ByteLevel"
        self._ranks = ranks if self.is_byte_level else None
        self._id_bytes: list[bytes | None] | None = None
        self._fast: TiktokenEncoder | None = None
        # What incremental tokenization's independence proof reads (None: the file was not plain JSON).
        self.pipeline_spec: dict[str, Any] | None = None if spec is None else {
            "normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"),
            "model": {k: v for k, v in model.items() if k not in ("vocab", "merges")}}
        self._max_token_bytes, self._shrink = self._length_bound_terms(spec)
        self.fast_path = False
        self.fast_path_reason = "tokenizers (fast path disabled by the caller)"
        backend = chosen_backend() if fast else "tokenizers"
        if backend == "tokenizers" and fast:
            self.fast_path_reason = "tokenizers (SPLITSERVE_TOKENIZER_BACKEND=tokenizers)"
        elif fast and spec is not None:
            merges = load_merges or (lambda: ((spec.get("model") or {}).get("merges") or []))
            self._try_fast_path(spec, ranks, merges, sha256)
        elif fast:
            self.fast_path_reason = "tokenizers (no tokenizer.json spec given)"
        self._fastokens: FastokensEncoder | None = None
        self.encode_backend = "tiktoken" if self.fast_path else "tokenizers"
        self.encode_backend_reason = self.fast_path_reason
        if backend == "auto" and data is not None:
            self._try_fastokens(data, sha256)

    def _try_fast_path(self, spec: dict[str, Any], ranks: dict[bytes, int] | None, load_merges: Callable[[], list[Any]],
                       sha256: str | None) -> None:
        try:
            fast = build_tiktoken_encoder(spec, self.hf, ranks, load_merges, sha256)
        except NotProvable as exc:
            self.fast_path_reason = f"tokenizers (not provably tiktoken-equivalent: {exc})"
            return
        for text in self_check_corpus(self.added_token_ids):
            if fast.encode(text) != self._hf_encode(text):
                self.fast_path_reason = f"tokenizers (self-check differs on {text[:40]!r})"
                return
        self._fast = fast
        self.fast_path = True
        self.fast_path_reason = "tiktoken (byte-level BPE proved equal to tokenizers; self-check passed)"

    def _try_fastokens(self, data: bytes, sha256: str | None) -> None:
        fallback = self._fast.encode if self._fast is not None else self._hf_encode
        try:
            self._fastokens = FastokensEncoder(data, sha256, self._hf_encode, fallback,
                                               self_check_corpus(self.added_token_ids))
        except FastokensUnavailable as exc:
            self.encode_backend_reason = f"{self.fast_path_reason}; not fastokens: {exc}"
            return
        self.encode_backend = "fastokens"
        self.encode_backend_reason = "fastokens (equal to tokenizers on the self-check corpus)"

    @classmethod
    def from_file(cls, path: str | Path, tokenizer_config: dict[str, Any] | None = None, *, fast: bool = True,
                  ) -> TextTokenizer:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from exc
        return cls.from_bytes(data, tokenizer_config, fast=fast)

    @classmethod
    def from_bytes(cls, data: bytes, tokenizer_config: dict[str, Any] | None = None, *, fast: bool = True,
                   ) -> TextTokenizer:
        """Load a tokenizer.json's content (its sha256 goes into the configuration fingerprint)."""
        try:
            hf = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise TokenizerError(f"tokenizer.json is not a valid tokenizer: {exc}") from exc
        try:
            spec = read_tokenizer_spec(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # tokenizers accepted it, so it is only unusual: stay on tokenizers.
            spec, fast = None, False
        special = {tok.content for tok in hf.get_added_tokens_decoder().values() if tok.special}
        ids = {hf.token_to_id(t) for t in special}
        return cls(hf, {i for i in ids if i is not None}, spec=spec, load_merges=lambda: read_merges(data),
                   sha256=hashlib.sha256(data).hexdigest(), fast=fast, data=data)

    def encode(self, text: str) -> list[int]:
        """Token IDs of ``text`` with no BOS/EOS added (chat templates write their own).

        Text with lone surrogates (not Unicode) raises ValueError on both paths: tokenizers refuses it,
        tiktoken would quietly replace it.
        """
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"text is not valid Unicode (lone surrogate at index {exc.start})") from None
        if self._fastokens is not None:
            return self._fastokens.encode(text)
        if self._fast is not None:
            return self._fast.encode(text)
        return self._hf_encode(text)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` that costs no tokenizing (0 where none is proved).

        Byte-level BPE: every token stands for at most ``max_token_bytes`` bytes of the normalized text; a
        character is at least one byte, and NFC shrinks UTF-8 by at most 3x (U+0390's decomposition is 6
        bytes, the character 2; 4 is used). ASCII is its own NFC.
        """
        if not self._max_token_bytes:
            return 0
        return len(text) // (self._max_token_bytes * (1 if text.isascii() else self._shrink))

    def _length_bound_terms(self, spec: dict[str, Any] | None) -> tuple[int, int]:
        """(longest token in bytes, how much the normalizer may shrink UTF-8); (0, 1) when unproved."""
        if self._ranks is None or spec is None:
            return 0, 1
        normalizer = spec.get("normalizer")
        steps = (normalizer or {}).get("normalizers") if (normalizer or {}).get("type") == "Sequence" \
            else [normalizer] if normalizer else []
        if any((step or {}).get("type") != "NFC" for step in steps or []):
            return 0, 1
        longest = max([len(raw) for raw in self._ranks] + [len(c) for c in self._added_content.values()])
        return longest, 4 if steps else 1

    def encode_between_added(self, text: str) -> list[int]:
        """``encode(text)`` for text already cut at the raw-matched added tokens (none left in it), and
        already checked for lone surrogates: the prompt piece cache's miss path, without the per-call
        checks and the added-token scan ``encode`` repeats."""
        if self._fastokens is not None:  # its own added-token scan finds nothing raw; normalized ones it must
            return self._fastokens.encode(text)
        if self._fast is not None:
            return self._fast.encode_segment(text)
        return self._hf_encode(text)

    def encode_many_between_added(self, texts: list[str]) -> list[Sequence[int]]:
        """``encode_between_added`` of each text (none empty), in one fastokens call where it has a proved
        batch path: the piece cache's miss path for a prompt it has not seen."""
        if self._fastokens is not None:
            return self._fastokens.encode_many(texts)
        return [tuple(self.encode_between_added(text)) for text in texts]

    def encode_ordinary(self, text: str) -> list[int] | None:
        """``text``'s IDs with added tokens taken as plain text (tiktoken's encode_ordinary); None off the fast
        path (``tokenizers`` always matches added tokens)."""
        if self._fast is None:
            return None
        if not text.isascii():
            text.encode("utf-8")  # lone surrogates raise, as in encode
        ids: list[int] = self._fast._encode_ordinary(text)
        return ids

    def _hf_encode(self, text: str) -> list[int]:
        if len(text) > GIL_FREE_ENCODE_CHARS:  # encode holds the GIL throughout, encode_batch lets it go
            return self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    # What incremental detokenizers need.

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of ``ids`` like HF's fast tokenizer; an unknown ID raises ValueError."""
        tokens = []
        for token_id in ids:
            token = self.hf.id_to_token(int(token_id))
            if token is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
            tokens.append(token)
        return tokens

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """HF's ``convert_tokens_to_string``: the tokenizer's decoder over vocabulary strings."""
        decoder = self.hf.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a byte-level token stands for; an added token gives its UTF-8 content.

        Raises TypeError for a tokenizer that is not byte-level, ValueError for an unknown ID.
        """
        table = self._bytes_table("token_bytes")
        raw = table[token_id] if 0 <= token_id < len(table) else None
        if raw is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return raw

    def bytes_of(self, ids: Iterable[int]) -> bytes:
        """The bytes ``ids`` stand for, one after another (byte-level tokenizers; TypeError otherwise, ValueError
        or IndexError for an id outside the vocabulary)."""
        table = self._bytes_table("bytes_of")
        try:
            return b"".join(map(table.__getitem__, ids))  # type: ignore[arg-type]
        except TypeError:  # an id with no bytes (None in the table)
            raise ValueError("an id in the list has no bytes") from None

    def byte_lengths(self) -> list[int]:
        """Every id's byte length (-1 for an id with no bytes); byte-level tokenizers (TypeError otherwise)."""
        return [-1 if raw is None else len(raw) for raw in self._bytes_table("byte_lengths")]

    def _bytes_table(self, caller: str) -> list[bytes | None]:
        """Each id's bytes (None for an id with none), built on first use; TypeError for a tokenizer that is not
        byte-level."""
        if self._ranks is None:
            raise TypeError(f"{caller} needs a byte-level BPE tokenizer")
        if self._id_bytes is None:
            self._id_bytes = self._byte_table(self._ranks)
        return self._id_bytes

    def _byte_table(self, ranks: dict[bytes, int]) -> list[bytes | None]:
        size = max([*ranks.values(), *self._added_content, -1]) + 1
        table: list[bytes | None] = [None] * size
        for raw, token_id in ranks.items():
            table[token_id] = raw
        for token_id, content in self._added_content.items():
            table[token_id] = content
        return table
