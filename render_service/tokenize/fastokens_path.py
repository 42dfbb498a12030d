"""tokenizer.json through fastokens, the fastest encode path the render tier has.

fastokens (Crusoe, Apache-2.0, on PyPI) runs the ``tokenizers`` pipeline of a tokenizer.json in Rust with a
PCRE2-JIT split regex and a word cache of its own: measured here on agent-trace text never seen before, about
4x tiktoken's CPU per token, and about 16x on text whose words it has seen (``docs/bench.md``, "Agent loops").
Nothing about it is taken on trust: an instance serves only after it equals ``tokenizers`` on the
self-check corpus, and any call that raises goes to the next path (tiktoken, else ``tokenizers``).

Costs paid for the speed, per process: ~0.8 s and 60-140 MB to build an instance (so one is shared by every
load of the same file), and a word cache that grows with distinct words to a bound of its own (~200 MB in a
test that fed it 20M distinct words: it stopped growing after about 4M).
"""

from __future__ import annotations

import array
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from render_service.caches.byte_lru import ByteLRU

# fastokens can spread one long encode over worker threads that spin while they wait for work. A render
# worker has concurrency of its own and is sized by CPU, so each encode stays on its caller's thread.
# An operator may still set the variable before start.
os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")

# SPLITSERVE_TOKENIZER_BACKEND picks the encode path: auto (fastokens, else tiktoken, else tokenizers),
# tiktoken (skip fastokens) or tokenizers (no fast path at all).
BACKEND_ENV = "SPLITSERVE_TOKENIZER_BACKEND"
BACKENDS = ("auto", "tiktoken", "tokenizers")

# One instance per tokenizer.json (by sha256) per process: every live TextTokenizer of a file shares it
# (_live), and the last few files loaded stay built after their tokenizers are gone (_recent: bounded by count,
# an instance's real size being fastokens' own business).
_RECENT_LIMIT = 4
_live: weakref.WeakValueDictionary[str, _Native] = weakref.WeakValueDictionary()
_recent: ByteLRU[str, _Native] = ByteLRU(sys.maxsize, max_entry_bytes=sys.maxsize, max_entries=_RECENT_LIMIT)
_shared_lock = threading.Lock()


def chosen_backend() -> str:
    from render_service.render.reference_mode import reference_render

    if reference_render():  # the plain path only (render/reference_mode.py)
        return "tokenizers"
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, not {value!r}")
    return value


class _Native:
    """Holds one fastokens instance (which cannot be weakly referenced itself)."""

    __slots__ = ("tokenizer", "__weakref__")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer


class FastokensUnavailable(Exception):
    """fastokens cannot serve this tokenizer (not installed, rejects the file, or differs on the self-check)."""


class FastokensEncoder:
    """``encode`` of a tokenizer.json through one fastokens instance, proved equal to ``reference`` first.

    ``reference`` is ``tokenizers``' own encode (no special tokens added); a call fastokens raises on is
    answered by ``fallback`` instead, so a PCRE2 limit or a bug on a strange input costs speed, not a 500.
    """

    def __init__(self, data: bytes, sha256: str | None, reference: Callable[[str], list[int]],
                 fallback: Callable[[str], list[int]], corpus: Iterable[str]) -> None:
        self._holder = _shared_instance(data, sha256)
        self._native = self._holder.tokenizer
        self._fallback = fallback
        texts = list(corpus)
        expected = []
        for text in texts:
            try:
                ids = self._native.encode(text).ids
            except Exception as exc:  # fastokens raises its own types; any of them disqualifies it
                raise FastokensUnavailable(f"fastokens fails on {text[:40]!r}: {exc}") from None
            expected.append(reference(text))
            if ids != expected[-1]:
                raise FastokensUnavailable(f"fastokens differs from tokenizers on {text[:40]!r}")
        # The batch path (one call for a prompt's new pieces) serves only where it gives the same ids too.
        self.batch = _FLAT_LAYOUT_OK and hasattr(self._native, "encode_batch_flat")
        if self.batch:
            try:
                self.batch = [list(ids) for ids in self._flat(texts)] == expected
            except Exception:
                self.batch = False

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` with added tokens matched as ``tokenizers`` matches them, nothing prepended."""
        try:
            ids: list[int] = self._native.encode(text).ids
        except Exception:  # a regex resource limit or an internal error: the proved path answers
            return self._fallback(text)
        return ids

    def encode_many(self, texts: list[str]) -> list[Sequence[int]]:
        """``encode`` of each text, in one call where the batch path proved equal at load: a cold prompt's
        pieces cost one crossing into Rust and no per-piece encoding objects (about half the CPU of a call
        per piece, measured on agent traces in ``docs/bench.md``)."""
        if self.batch:
            try:
                return self._flat(texts)
            except Exception:  # as in encode: the proved per-text path answers
                pass
        return [tuple(self.encode(text)) for text in texts]

    def _flat(self, texts: list[str]) -> list[Sequence[int]]:
        """Each text's ids as a slice of the batch's one 32-bit array (no int object made per id)."""
        raw_ids, raw_offsets = self._native.encode_batch_flat(texts)
        ids = array.array("I")
        ids.frombytes(raw_ids)
        offsets = array.array("Q")
        offsets.frombytes(raw_offsets)
        if len(offsets) != len(texts) + 1 or offsets[-1] != len(ids):
            raise ValueError("fastokens' flat batch has an unexpected shape")
        return [ids[offsets[k]:offsets[k + 1]] for k in range(len(texts))]


# encode_batch_flat writes little-endian uint32 ids and uint64 offsets: read with array where its items match.
_FLAT_LAYOUT_OK = (sys.byteorder == "little" and array.array("I").itemsize == 4
                   and array.array("Q").itemsize == 8)


def _shared_instance(data: bytes, sha256: str | None) -> _Native:
    try:
        import fastokens
    except ImportError:
        raise FastokensUnavailable("fastokens is not installed") from None
    if sha256 is not None:
        with _shared_lock:
            found = _live.get(sha256)
            if found is not None:
                _remember(sha256, found)
                return found
    try:
        native = fastokens.Tokenizer.from_json_str(data.decode("utf-8"))
    except Exception as exc:  # a model type or pipeline step fastokens does not implement
        raise FastokensUnavailable(f"fastokens rejects this tokenizer.json: {exc}") from None
    native.no_truncation()  # as TextTokenizer does to tokenizers: a length limit in the file must not cut encode
    native.no_padding()
    holder = _Native(native)
    if sha256 is not None:
        with _shared_lock:
            holder = _live.setdefault(sha256, holder)  # another thread may have built it meanwhile
            _remember(sha256, holder)
    return holder


def _remember(sha256: str, holder: _Native) -> None:
    if _recent.get(sha256) is None:
        _recent.put(sha256, holder, 1)
