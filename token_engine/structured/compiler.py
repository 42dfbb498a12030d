"""Compiles GuideSpecs into grammars with xgrammar (vLLM's default backend), off the engine's step loop.

The engine never sees text, but a grammar needs the vocabulary: the model directory's tokenizer.json is
loaded on the first structured request only (a model without one answers such requests with a 400).
Compiled grammars are cached by GuideSpec; failures are cached too, so a bad or pathological spec sent
again costs nothing. A compile runs on a thread of its own and the caller waits a bounded time: a schema
that compiles for too long fails its request (the compile itself runs to its end; the library cannot be
interrupted), and the step loop never waits for a compile at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from token_engine.structured.spec import GrammarError, GuideSpec

MAX_CACHED_GRAMMARS = 512
MAX_CONCURRENT_COMPILES = 2  # a flood of slow specs queues here instead of taking every core
REASONING_END = "</think>"  # the <think>-style reasoning parsers' end marker (qwen3, deepseek_r1, ...)
VOCAB_LOAD_TIMEOUT_S = 300.0  # loading the vocabulary is the server's work, not the client's: generous
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def _library_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LIBRARY_PREFIX.sub("", text.splitlines()[0]).strip()


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of the choices (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Vocabulary + compiled-grammar cache for one model. Thread-safe: the server's event loop compiles,
    the engine thread only reads what it was handed."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int],
                 compile_timeout_s: float = 10.0):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(MAX_CONCURRENT_COMPILES)
        self._compiler_future: concurrent.futures.Future | None = None
        self._grammars: OrderedDict[GuideSpec, concurrent.futures.Future] = OrderedDict()
        self._reasoning_end: int | None = None

    @property
    def reasoning_end_token_id(self) -> int | None:
        """The vocabulary's </think> (None without one, or before the vocabulary is loaded)."""
        return self._reasoning_end

    # ---- public ------------------------------------------------------------------------------------
    def compile(self, spec: GuideSpec, timeout_s: float | None = None) -> Any:
        """The compiled grammar for spec, blocking (for synchronous callers); GrammarError on failure."""
        future = self._grammar_future(spec)
        try:
            self._compiler().result(VOCAB_LOAD_TIMEOUT_S)  # loaded once, outside the per-spec time limit
            return future.result(self.compile_timeout_s if timeout_s is None else timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow() from None

    async def compile_async(self, spec: GuideSpec) -> Any:
        """The compiled grammar for spec without blocking the event loop; GrammarError on failure."""
        compiler = self._compiler()
        if not compiler.done():  # the vocabulary is loaded once, outside the per-spec time limit
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiler)), VOCAB_LOAD_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise GrammarError("structured_outputs: the vocabulary did not load within "
                                   f"{VOCAB_LOAD_TIMEOUT_S:g} s.") from None
        future = self._grammar_future(spec)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.compile_timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow() from None

    # ---- internals ---------------------------------------------------------------------------------
    def _too_slow(self) -> GrammarError:
        return GrammarError(f"structured_outputs: the grammar did not compile within {self.compile_timeout_s:g} s; "
                            "simplify the schema, regex or grammar.")

    def _compiler(self) -> concurrent.futures.Future:
        with self._lock:
            if self._compiler_future is None:
                self._compiler_future = _run_on_thread(self._load_compiler, "structured-vocab")
            return self._compiler_future

    def _grammar_future(self, spec: GuideSpec) -> concurrent.futures.Future:
        with self._lock:
            future = self._grammars.get(spec)
            if future is not None:
                self._grammars.move_to_end(spec)
                return future
            future = _run_on_thread(lambda: self._compile_now(spec), "structured-compile")
            self._grammars[spec] = future
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                oldest = next(iter(self._grammars))
                if not self._grammars[oldest].done():
                    break  # still compiling: keep it, the cache shrinks on a later insert
                del self._grammars[oldest]
            return future

    def _load_compiler(self):
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"structured_outputs need the model's vocabulary, and {self.model_dir} has no "
                               "tokenizer.json.")
        try:
            import xgrammar
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:  # an engine installed without the grammar library
            raise GrammarError(f"structured_outputs need the xgrammar package on the engine ({exc}).") from None
        from tokenizers import Tokenizer

        try:
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)))
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
        except Exception as exc:  # noqa: BLE001 - a broken file still gets a clear answer, not a 500
            raise GrammarError(f"structured_outputs: {path} could not be loaded: {_library_message(exc)}") from None
        self._reasoning_end = tokenizer.get_vocab().get(REASONING_END)
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def _compile_now(self, spec: GuideSpec):
        compiler = self._compiler().result()  # raises the vocabulary's GrammarError for every spec
        with self._slots:
            try:
                return _compile_spec(compiler, spec)
            except GrammarError:
                raise
            except Exception as exc:  # noqa: BLE001 - the library's own message is the client's answer
                raise GrammarError(f"structured_outputs.{spec.kind}: {_library_message(exc)}") from None


def _compile_spec(compiler, spec: GuideSpec):
    import xgrammar

    if spec.kind == "json":
        return compiler.compile_json_schema(spec.value, any_whitespace=spec.any_whitespace)
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.value)
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
    tag = json.loads(spec.value)  # structural_tag: vLLM's older {"structures", "triggers"} form, or xgrammar's
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            triggers = list(tag["triggers"])
        except (KeyError, TypeError) as exc:
            raise GrammarError(f"structured_outputs.structural_tag: malformed structures ({exc!r}).") from None
        return compiler.compile_structural_tag(items, triggers)
    return compiler.compile_structural_tag(spec.value)


def _run_on_thread(fn, name: str) -> concurrent.futures.Future:
    """fn() on its own thread. Not a daemon: the interpreter waits for a compile still running at exit, since
    tearing down the library under a running compile aborts the process."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    threading.Thread(target=run, name=name).start()
    return future
