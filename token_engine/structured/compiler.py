"""Compiles GuideSpecs into grammars with xgrammar (vLLM's default backend), off the engine's step loop.

The engine never sees text, but a grammar needs the vocabulary: the model directory's tokenizer.json is
loaded on the first structured request only (a model without one answers such requests with a 400).
Compiled grammars are cached by GuideSpec; failures are cached too, so a bad or pathological spec sent
again costs nothing. A cached grammar is handed out at once. Anything else is first checked against
cheap bounds (bounds.py: size, nesting, repeats, properties, values; a 400 naming the limit), then
compiled in a worker process (pool.py) that is killed when the compile runs past the time limit: xgrammar
cannot interrupt a compile, and a thread could not be stopped. The worker returns the grammar serialized
by xgrammar; it is deserialized here against the same vocabulary. The step loop never waits for a compile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from token_engine.structured.bounds import DEFAULT_LIMITS, CompileLimits, check_bounds
from token_engine.structured.pool import (
    DEFAULT_POOL_LIMITS,
    CompileBusy,
    CompilePool,
    CompilerClosed,
    PoolLimits,
    start_zygote,
)
from token_engine.structured.spec import GrammarError, GuideSpec
from token_engine.structured.worker import choice_grammar, library_message

__all__ = ["GrammarCompiler", "choice_grammar"]

MAX_CACHED_GRAMMARS = 512
REASONING_END = "</think>"  # the <think>-style reasoning parsers' end marker (qwen3, deepseek_r1, ...)
VOCAB_LOAD_TIMEOUT_S = 300.0  # loading the vocabulary is the server's work, not the client's: generous
LOCAL_CLIENT = "local"  # synchronous in-process callers (tests, offline use)


class GrammarCompiler:
    """Vocabulary + compiled-grammar cache + compile workers for one model. Thread-safe: the server's event
    loop compiles, the engine thread only reads what it was handed. close() stops the workers."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int],
                 compile_timeout_s: float = 10.0, limits: CompileLimits = DEFAULT_LIMITS,
                 pool_limits: PoolLimits = DEFAULT_POOL_LIMITS):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self.pool_limits = pool_limits
        self._compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._pool_future: concurrent.futures.Future | None = None
        self._grammars: OrderedDict[GuideSpec, concurrent.futures.Future] = OrderedDict()
        self._reasoning_end: int | None = None

    @property
    def reasoning_end_token_id(self) -> int | None:
        """The vocabulary's </think> (None without one, or before the vocabulary is loaded)."""
        return self._reasoning_end

    @property
    def compile_timeout_s(self) -> float:
        return self._compile_timeout_s

    @compile_timeout_s.setter
    def compile_timeout_s(self, value: float) -> None:  # applies to compiles started from now on
        self._compile_timeout_s = value
        pool = self._pool_future
        if pool is not None and pool.done() and pool.exception() is None:
            pool.result().compile_timeout_s = value

    # ---- public ------------------------------------------------------------------------------------
    def compile(self, spec: GuideSpec, client: str = LOCAL_CLIENT) -> Any:
        """The compiled grammar for spec, blocking (for synchronous callers); GrammarError on failure."""
        cached = self._cached(spec)
        if cached is not None:
            return cached.result()
        self._pool().result(VOCAB_LOAD_TIMEOUT_S)  # loaded once, outside the per-spec time limit
        return self._grammar_future(spec, client).result(self._wait_limit_s())

    async def compile_async(self, spec: GuideSpec, client: str = LOCAL_CLIENT) -> Any:
        """The compiled grammar for spec without blocking the event loop; GrammarError on failure."""
        cached = self._cached(spec)
        if cached is not None:  # the fast path: no thread, no worker, no waiting
            return cached.result()
        pool = self._pool()
        if not pool.done():  # the vocabulary and the workers start once, outside the per-spec time limit
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pool)), VOCAB_LOAD_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise GrammarError("structured_outputs: the vocabulary did not load within "
                                   f"{VOCAB_LOAD_TIMEOUT_S:g} s.") from None
        # the bounds check reads up to max_spec_bytes in Python: off the event loop, like the compile
        future = await asyncio.to_thread(self._grammar_future, spec, client)
        try:
            # The pool always ends the future (compile limit, queue limit, close); this bound is a backstop.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self._wait_limit_s())
        except asyncio.TimeoutError:
            raise CompileBusy("structured_outputs: the grammar compile did not finish in time; retry later.") from None

    def warm_up(self) -> None:
        """Starts loading the vocabulary and the compile workers now, in the background, so the first
        structured request does not wait for them (a no-op without tokenizer.json: that request says why)."""
        if (self.model_dir / "tokenizer.json").is_file():
            try:
                self._pool()
            except CompilerClosed:
                pass

    def worker_pids(self) -> list[int]:
        pool = self._pool_future
        if pool is None or not pool.done() or pool.exception() is not None:
            return []
        return pool.result().worker_pids()

    def close(self, wait_s: float = 0.0) -> None:
        """Stops the compile workers (what waits fails with a 503); later compiles fail the same way.
        ``wait_s``: how long to wait for a vocabulary load still under way. The process exit must wait for it:
        an interpreter that finalizes while the loader thread is inside xgrammar's C++ aborts (SIGABRT,
        "terminate called without an active exception") instead of exiting 0."""
        with self._lock:
            self._closed = True
            pool = self._pool_future
        if pool is not None:  # still loading: the loader sees _closed and starts no workers
            pool.add_done_callback(lambda f: f.exception() is None and f.result().close())
            if wait_s > 0:
                concurrent.futures.wait([pool], timeout=wait_s)

    # ---- internals ---------------------------------------------------------------------------------
    def _wait_limit_s(self) -> float:
        return self.pool_limits.queue_timeout_s + self._compile_timeout_s + 30.0

    def _cached(self, spec: GuideSpec) -> concurrent.futures.Future | None:
        with self._lock:
            future = self._grammars.get(spec)
            if future is None or not future.done():
                return None
            self._grammars.move_to_end(spec)
            return future

    def _pool(self) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise CompilerClosed("structured_outputs: the engine is shutting down.")
            if self._pool_future is None:
                self._pool_future = _run_on_thread(self._start_pool, "structured-vocab")
            return self._pool_future

    def _grammar_future(self, spec: GuideSpec, client: str) -> concurrent.futures.Future:
        pool = self._pool().result()  # raises the vocabulary's GrammarError for every spec
        with self._lock:
            future = self._grammars.get(spec)
            if future is not None:  # compiled, failed, or compiling for someone else: shared
                self._grammars.move_to_end(spec)
                return future
        try:
            check_bounds(spec, self.limits)
        except GrammarError as exc:
            future = concurrent.futures.Future()
            future.set_exception(exc)
            return future  # not cached: checking again is as cheap as a lookup
        with self._lock:
            future = self._grammars.get(spec)
            if future is not None:
                return future
            future = pool.submit(spec, client)  # CompileBusy / CompilerClosed: raised, nothing cached
            self._grammars[spec] = future
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                oldest = next(iter(self._grammars))
                if not self._grammars[oldest].done():
                    break  # still compiling: keep it, the cache shrinks on a later insert
                del self._grammars[oldest]
        future.add_done_callback(lambda f: self._forget_if_transient(spec, f))
        return future

    def _forget_if_transient(self, spec: GuideSpec, future: concurrent.futures.Future) -> None:
        if isinstance(future.exception(), (CompileBusy, CompilerClosed)):  # worth sending again later
            with self._lock:
                if self._grammars.get(spec) is future:
                    del self._grammars[spec]

    def _start_pool(self) -> CompilePool:
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

        zygote = start_zygote()  # imports xgrammar in its own process while this one loads the vocabulary
        try:
            try:
                tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)))
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids or None)
            except Exception as exc:  # noqa: BLE001 - a broken file still gets a clear answer, not a 500
                raise GrammarError(f"structured_outputs: {path} could not be loaded: "
                                   f"{library_message(exc)}") from None
            self._reasoning_end = tokenizer.get_vocab().get(REASONING_END)
            with self._lock:
                if self._closed:
                    raise CompilerClosed("structured_outputs: the engine is shutting down.")
            # the workers get the vocabulary as xgrammar's JSON: faster than loading tokenizer.json again
            return CompilePool(zygote, info.serialize_json().encode(),
                               lambda text: xgrammar.CompiledGrammar.deserialize_json(text, info),
                               self._compile_timeout_s, self.pool_limits)
        except BaseException:
            zygote.kill()
            raise


def _run_on_thread(fn, name: str) -> concurrent.futures.Future:
    """fn() on a daemon thread of its own (it only loads files and starts worker processes)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
