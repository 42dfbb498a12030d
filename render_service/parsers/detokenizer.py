"""Incremental detokenization: token IDs in, newly completed text out.

Two paths with one observable behaviour, vLLM's offset algorithm (``detokenize_incrementally``):

* byte-level tokenizers (GPT-2/Qwen/Llama-3 style ByteLevel decoder): every token maps to a fixed byte
  string, so the state is just the bytes of an unfinished UTF-8 character. O(1) per token.
* any other tokenizer (Metaspace/SentencePiece, WordPiece, ...): vLLM's prefix/read-offset window over
  token strings, decoded by the tokenizer's own decoder; the window is trimmed to start at the prefix
  offset so it stays a handful of tokens.

Text is withheld while it ends in U+FFFD (an incomplete character) exactly like vLLM; a character still
incomplete when the output ends is dropped, never flushed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from render_service.tokenize.byte_level import byte_level_token_bytes

if TYPE_CHECKING:
    from render_service.tokenize.tokenizer import RenderTokenizer

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: the prompt tail that seeds the window.
PROMPT_SEED_TOKENS = 5
REPLACEMENT = "\ufffd"


class DetokenizerConfig(msgspec.Struct, frozen=True):
    skip_special_tokens: bool = True
    # vLLM ignores this for fast tokenizers (every tokenizer here is a `tokenizers` one); kept so the
    # request field round-trips and a slow-tokenizer path could honour it.
    spaces_between_special_tokens: bool = True
    # Token IDs whose text never appears (EOS: vLLM does not detokenize the stop token).
    hidden_token_ids: frozenset[int] = frozenset()


class DetokenizerState(msgspec.Struct, omit_defaults=True):
    """Byte-level path uses ``pending``; the general path uses the window and offsets."""

    pending: bytes = b""
    window: list[str] = []
    prefix_offset: int = 0
    read_offset: int = 0


class _TokenTables:
    """Per-tokenizer lookup tables, filled lazily and shared by every request."""

    def __init__(self, tokenizer: RenderTokenizer) -> None:
        hf = tokenizer.hf
        self.hf = hf
        flag = getattr(tokenizer, "is_byte_level", None)
        self.is_byte_level = bool(flag) if flag is not None else type(hf.decoder).__name__ == "ByteLevel"
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(getattr(tokenizer, "special_token_ids", ()) or ())
        self._strings: dict[int, str] = {}
        self.token_bytes: dict[int, bytes] = {}
        # The text of each token whose bytes are whole UTF-8 on their own (most of them): with nothing
        # pending, such a token's text needs no decode.
        self.token_text: dict[int, str] = {}
        self.decoder = hf.decoder

    def token_string(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            s = self.hf.id_to_token(token_id) or ""
            self._strings[token_id] = s
        return s

    def bytes_of(self, token_id: int) -> bytes:
        b = byte_level_token_bytes(self.token_string(token_id))
        self.token_bytes[token_id] = b
        return b


_TABLES: weakref.WeakKeyDictionary[RenderTokenizer, _TokenTables] = weakref.WeakKeyDictionary()


def token_tables(tokenizer: RenderTokenizer) -> _TokenTables:
    tables = _TABLES.get(tokenizer)
    if tables is None:
        tables = _TokenTables(tokenizer)
        _TABLES[tokenizer] = tables
    return tables


class IncrementalDetokenizer:
    """Configured once per request; ``step`` turns a chunk of token IDs into newly completed text."""

    def __init__(self, tokenizer: RenderTokenizer, config: DetokenizerConfig = DetokenizerConfig()) -> None:
        self.config = config
        self.tables = token_tables(tokenizer)
        hidden = set(config.hidden_token_ids)
        if config.skip_special_tokens:
            hidden |= self.tables.special_ids
        self._hidden = frozenset(hidden)

    @property
    def is_byte_level(self) -> bool:
        return self.tables.is_byte_level

    def initial_state(self, prompt_token_ids: Sequence[int] | None = None) -> DetokenizerState:
        """Seed from the prompt tail, as vLLM does, so the first token keeps its leading space."""
        if self.tables.is_byte_level or not prompt_token_ids:
            # Byte-level text of a token never depends on its neighbours; the prompt tail is irrelevant.
            return DetokenizerState()
        strings = [self._token_string(t) for t in prompt_token_ids[-(PROMPT_SEED_TOKENS + 2):]]
        tail = [t for t in strings if t is not None]
        read = len(tail)
        return DetokenizerState(window=tail, prefix_offset=max(read - PROMPT_SEED_TOKENS, 0), read_offset=read)

    def step(self, state: DetokenizerState, token_ids: list[int]) -> str:
        """Text completed by ``token_ids`` (mutates ``state``)."""
        if self.tables.is_byte_level:
            return self._step_bytes(state, token_ids)
        return "".join(self._step_window(state, t) for t in token_ids)

    # byte-level path -------------------------------------------------------------------------------

    def _step_bytes(self, state: DetokenizerState, token_ids: list[int]) -> str:
        tables = self.tables
        table = tables.token_bytes
        texts = tables.token_text
        size = tables.vocab_size
        hidden = self._hidden
        out: list[str] = []
        for t in token_ids:
            if t in hidden or not 0 <= t < size:
                continue
            if not state.pending:
                text = texts.get(t)
                if text is not None:
                    out.append(text)
                    continue
            tb = table.get(t)
            if tb is None:
                tb = tables.bytes_of(t)
            data = state.pending + tb if state.pending else tb
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = data.decode("utf-8", "replace")
            if text.endswith(REPLACEMENT):
                # Incomplete (or invalid) tail: vLLM withholds everything until the text stops ending in U+FFFD.
                state.pending = data
                continue
            if data is tb and REPLACEMENT not in text:
                texts[t] = text  # whole on its own (a token decoding to U+FFFD itself goes the long way)
            state.pending = b""
            out.append(text)
        return out[0] if len(out) == 1 else "".join(out)

    # general path (vLLM's prefix/read offsets) -----------------------------------------------------------

    def _token_string(self, token_id: int) -> str | None:
        if token_id in self._hidden:
            return None
        if not 0 <= token_id < self.tables.vocab_size:
            return ""
        return self.tables.token_string(token_id)

    def _decode(self, tokens: list[str]) -> str:
        return self.tables.decoder.decode(tokens) if self.tables.decoder is not None else "".join(tokens)

    def _step_window(self, state: DetokenizerState, token_id: int) -> str:
        tok = self._token_string(token_id)
        if tok is None:
            return ""
        window = state.window
        window.append(tok)
        prefix_text = self._decode(window[state.prefix_offset:state.read_offset])
        new_text = self._decode(window[state.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        # Advance the offsets, then trim so the window starts at the prefix offset (bounded state).
        start = state.read_offset
        del window[:start]
        state.prefix_offset = 0
        state.read_offset = len(window)
        return delta


def pending_bytes_from_token_strings(tokens: list[str]) -> bytes:
    """Byte-level pending bytes for vLLM's window tokens[read_offset:] (used to adopt vLLM-shaped state)."""
    return b"".join(byte_level_token_bytes(t) for t in tokens)
