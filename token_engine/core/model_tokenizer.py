"""The model directory's tokenizer.json, loaded on first use: a tokens-only engine never pays for it.

Read by the few features that need text (bad_words, output_mode text and derender); one instance per
engine, shared by them, so the file is parsed once.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class TokenizerUnavailable(Exception):
    """The model has no usable tokenizer.json; ``missing`` tells an absent file from a broken one."""

    def __init__(self, message: str, missing: bool):
        super().__init__(message)
        self.missing = missing


class ModelTokenizer:
    """Thread-safe; a file that is absent or fails to load is remembered, not tried again per request."""

    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir) / "tokenizer.json"
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._broken: TokenizerUnavailable | None = None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def get(self) -> Tokenizer:
        """The tokenizer, or TokenizerUnavailable."""
        with self._lock:
            if self._tokenizer is None:
                if self._broken is None and not self.path.is_file():
                    self._broken = TokenizerUnavailable("the model directory has no tokenizer.json", missing=True)
                if self._broken is not None:
                    raise self._broken
                from tokenizers import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_file(str(self.path))
                except Exception as exc:  # noqa: BLE001 - a broken file still gets a clear answer, not a 500
                    self._broken = TokenizerUnavailable(
                        f"the model's tokenizer.json could not be loaded ({type(exc).__name__})", missing=False)
                    raise self._broken from None
            return self._tokenizer
