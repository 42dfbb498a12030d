"""Text <-> token IDs for the render tier.

Minimal first version over HF `tokenizers`; the fast path (tiktoken, proven identical at load time)
is added behind the same interface.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """The tokenizer interface the rest of the render tier uses."""

    def __init__(self, hf: Tokenizer, special_token_ids: set[int]) -> None:
        self.hf = hf
        self.special_token_ids = special_token_ids
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer_config: dict | None = None) -> "TextTokenizer":
        hf = Tokenizer.from_file(str(path))
        special = {tok.content for tok in hf.get_added_tokens_decoder().values() if tok.special}
        ids = {hf.token_to_id(t) for t in special}
        return cls(hf, {i for i in ids if i is not None})

    def encode(self, text: str) -> list[int]:
        """Token IDs of ``text`` with no BOS/EOS added (chat templates write their own)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)
