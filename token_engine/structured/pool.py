"""A small pool of grammar-compile worker processes (worker.py): compiles that can be stopped.

One dispatcher thread per worker takes the next job, sends it, and waits at most the compile time limit
for the serialized grammar; a compile that runs over is killed with its process, and the dispatcher starts
a replacement before it takes another job. Jobs wait in one queue, and fairly: a free worker goes to the
waiting client with the fewest compiles running, and no client runs on more than workers - 1 of them at
once (with two or more), so one client's slow specs always leave a worker for everybody else. How many
compiles a client, and everybody together, may have waiting or running is capped (429 beyond), and so is
how long a job may wait for a worker. close() fails what waits, kills the workers and joins the threads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from token_engine.structured import worker as wire
from token_engine.structured.spec import GrammarError, GuideSpec

log = logging.getLogger("token_engine.structured")
_WAIT = object()
WORKER_START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a loaded machine; not the client's time


@dataclass(frozen=True)
class PoolLimits:
    workers: int = 2
    per_client_pending: int = 16  # compiles one client may have waiting or running (fairness keeps others first)
    max_pending: int = 64  # compiles everybody together may have waiting or running
    queue_timeout_s: float = 10.0  # how long a job may wait for a free worker


DEFAULT_POOL_LIMITS = PoolLimits()


class CompileBusy(GrammarError):
    """Over a compile cap: retry later (429). Never cached."""

    status = 429


class CompilerClosed(GrammarError):
    """The engine is shutting down (503). Never cached."""

    status = 503


@dataclass(eq=False)
class _Job:
    spec: GuideSpec
    client: str
    enqueued: float
    seq: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    running: bool = False
    released: bool = False


def start_zygote() -> _Zygote:
    return _Zygote()


class _Zygote:
    """The process that forks workers (zygote.py), and the engine's end of its control socket."""

    def __init__(self):
        """Starts the process; it imports xgrammar while the engine loads the vocabulary for handshake()."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "token_engine.structured.zygote", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()

    def handshake(self, vocabulary_json: bytes) -> None:
        """Sends the vocabulary; GrammarError (process killed) when the zygote does not get ready."""
        channel = Connection(os.dup(self._control.fileno()))
        try:
            channel.send_bytes(vocabulary_json)
            if not channel.poll(WORKER_START_TIMEOUT_S):
                raise TimeoutError
            reply = channel.recv_bytes()
        except (OSError, EOFError, TimeoutError):
            self.kill()
            raise GrammarError("structured_outputs: the grammar compiler did not start.") from None
        finally:
            channel.close()
        if reply != wire.READY:
            self.kill()
            raise GrammarError(reply[1:].decode(errors="replace"))

    def fork(self) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self._control, [wire.FORK], [theirs.fileno()])
                answer = b""
                while len(answer) < wire.PID.size:
                    chunk = self._control.recv(wire.PID.size - len(answer))
                    if not chunk:
                        raise EOFError
                    answer += chunk
        except (OSError, EOFError):
            ours.close()
            raise GrammarError("structured_outputs: the grammar compiler is not running.") from None
        finally:
            theirs.close()
        return _Worker(wire.PID.unpack(answer)[0], Connection(ours.detach()))

    def kill(self) -> None:
        self._control.close()  # the zygote ends on EOF; its workers die with it
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Worker:
    """One forked worker: its pid (the zygote reaps it) and the engine's end of its socket."""

    def __init__(self, pid: int, channel: Connection):
        self.pid = pid
        self._channel = channel
        self._killed = False

    def compile(self, spec: GuideSpec, timeout_s: float) -> bytes:
        self._channel.send_bytes(wire.encode_job(spec))
        if not self._channel.poll(timeout_s):
            raise TimeoutError
        return self._channel.recv_bytes()

    def stop(self) -> None:
        """Kills the process only: its dispatcher, which may be waiting on the socket, sees EOF and closes it."""
        if not self._killed:
            self._killed = True
            try:
                os.kill(self.pid, signal.SIGKILL)  # alive until now: workers only exit when killed or closed
            except ProcessLookupError:
                pass

    def kill(self) -> None:  # the dispatcher's own thread only
        self.stop()
        self._channel.close()


class CompilePool:
    def __init__(self, zygote: _Zygote, vocabulary_json: bytes, deserialize, compile_timeout_s: float,
                 limits: PoolLimits = DEFAULT_POOL_LIMITS):
        self.compile_timeout_s = compile_timeout_s  # read per job: tests and operators may change it
        self.limits = limits
        self.per_client_running = max(1, limits.workers - 1)
        self._vocabulary_json = vocabulary_json
        self._deserialize = deserialize  # serialized grammar (str) -> compiled grammar, in this process
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._pending: Counter[str] = Counter()
        self._running: Counter[str] = Counter()
        self._seq = itertools.count()
        self._closed = False
        self._ready_since = float("inf")  # queue waits count from the first worker's start
        self._workers: dict[int, _Worker] = {}
        zygote.handshake(vocabulary_json)  # GrammarError when it cannot start: every spec gets it
        self._zygote = zygote
        self._zygote_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._dispatch, args=(slot,), name=f"grammar-dispatch-{slot}",
                                          daemon=True) for slot in range(limits.workers)]
        for thread in self._threads:
            thread.start()

    # ---- public ------------------------------------------------------------------------------------
    def submit(self, spec: GuideSpec, client: str) -> concurrent.futures.Future:
        """A future of the compiled grammar; CompileBusy when a cap is reached, CompilerClosed after close()."""
        with self._cond:
            if self._closed:
                raise CompilerClosed("structured_outputs: the engine is shutting down.")
            total = sum(self._pending.values())
            if total >= self.limits.max_pending:
                raise CompileBusy(f"structured_outputs: the engine is already compiling {total} grammars "
                                  f"(max_pending_compiles={self.limits.max_pending}); retry later.")
            if self._pending[client] >= self.limits.per_client_pending:
                raise CompileBusy(f"structured_outputs: this client already has {self._pending[client]} grammar "
                                  f"compiles waiting or running (per_client_pending_compiles="
                                  f"{self.limits.per_client_pending}); retry when one finishes.")
            job = _Job(spec, client, time.monotonic(), next(self._seq))
            self._queue.append(job)
            self._pending[client] += 1
            self._cond.notify_all()
        return job.future

    def worker_pids(self) -> list[int]:
        """The processes this pool runs (the zygote first), for tests and operators."""
        with self._cond:
            return [self._zygote.proc.pid] + [w.pid for w in self._workers.values()]

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            queued, self._queue = self._queue, []
            workers = list(self._workers.values())
            self._cond.notify_all()
        for job in queued:
            self._fail(job, CompilerClosed("structured_outputs: the engine is shutting down."))
        for w in workers:  # a dispatcher waiting on one sees EOF and ends
            w.stop()
        with self._zygote_lock:
            self._zygote.kill()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # ---- dispatching -------------------------------------------------------------------------------
    def _dispatch(self, slot: int) -> None:
        worker: _Worker | None = None
        try:
            while True:
                if worker is None:
                    worker = self._start_worker(slot)
                    if worker is None:
                        return
                job = self._next_job()
                if job is None:
                    return
                worker = self._run(worker, job)
                if worker is None:
                    with self._cond:
                        self._workers.pop(slot, None)
        finally:
            if worker is not None:
                worker.kill()
            with self._cond:
                self._workers.pop(slot, None)

    def _start_worker(self, slot: int) -> _Worker | None:
        while True:
            try:
                with self._zygote_lock:
                    if self._closed:
                        return None
                    if self._zygote.proc.poll() is not None:  # killed from outside (OOM killer): once more
                        log.error("grammar compile zygote exited (%s); starting another", self._zygote.proc.returncode)
                        self._zygote = start_zygote()
                        self._zygote.handshake(self._vocabulary_json)
                    worker = self._zygote.fork()
            except GrammarError as exc:
                with self._cond:
                    if self._closed:
                        return None
                    failed, self._queue = self._queue, []  # nothing can compile them: say why, now
                log.error("grammar compile worker failed to start: %s", exc.message)
                for job in failed:
                    self._fail(job, exc)
                time.sleep(1.0)
                continue
            with self._cond:
                if self._closed:
                    worker.kill()
                    return None
                self._workers[slot] = worker
                self._ready_since = min(self._ready_since, time.monotonic())
            return worker

    def _next_job(self) -> _Job | None:
        """The next job to run, fairly (see the module docstring); None once closed."""
        while True:
            expired: list[_Job] = []
            with self._cond:
                job = self._pick(expired)
            for old in expired:  # futures are completed outside the lock: their callbacks take other locks
                old.future.set_exception(CompileBusy(f"structured_outputs: no grammar compile worker was free "
                                                     f"within {self.limits.queue_timeout_s:g} s; retry later."))
            if job is not _WAIT:
                return job

    def _pick(self, expired: list[_Job]):
        """Under the lock: a job, None when closed, or _WAIT after waiting (or expiring some) once."""
        if self._closed:
            return None
        now = time.monotonic()
        started = self._ready_since
        for job in [j for j in self._queue if now - max(j.enqueued, started) > self.limits.queue_timeout_s]:
            self._queue.remove(job)
            self._release(job)
            expired.append(job)
        if expired:
            return _WAIT
        runnable = [j for j in self._queue if self._running[j.client] < self.per_client_running]
        if runnable:
            job = min(runnable, key=lambda j: (self._running[j.client], j.seq))
            self._queue.remove(job)
            self._running[job.client] += 1
            job.running = True
            return job
        waits = [max(j.enqueued, started) + self.limits.queue_timeout_s - now for j in self._queue]
        self._cond.wait(max(0.01, min(waits)) if waits and started < float("inf") else None)
        return _WAIT

    def _run(self, worker: _Worker, job: _Job) -> _Worker | None:
        """Runs job on worker; the worker to use next (None: it was killed and must be replaced)."""
        timeout_s = self.compile_timeout_s
        error: GrammarError | None = None
        reply = b""
        try:
            reply = worker.compile(job.spec, timeout_s)
        except TimeoutError:
            error = GrammarError(f"structured_outputs: the grammar did not compile within {timeout_s:g} s; "
                                 "simplify the schema, regex or grammar.")
        except (OSError, EOFError):
            with self._cond:
                closed = self._closed
            error = (CompilerClosed("structured_outputs: the engine is shutting down.") if closed else
                     GrammarError(f"structured_outputs.{job.spec.kind}: the grammar compiler crashed on this "
                                  "constraint."))
        if error is not None:
            worker.kill()
            if not isinstance(error, CompilerClosed):
                log.warning("grammar compile worker %d killed: %s", worker.pid, error.message)
            self._fail(job, error)
            return None
        if reply[:1] == wire.GRAMMAR:
            try:
                result = self._deserialize(reply[1:].decode())
            except Exception as exc:  # noqa: BLE001 - a version mismatch would be ours, but still an answer
                self._fail(job, GrammarError(f"structured_outputs: the compiled grammar could not be loaded "
                                             f"({wire.library_message(exc)})."))
            else:
                self._release(job)
                job.future.set_result(result)
        else:
            self._fail(job, GrammarError(reply[1:].decode(errors="replace")))
        return worker

    def _fail(self, job: _Job, error: GrammarError) -> None:
        self._release(job)
        if not job.future.done():
            job.future.set_exception(error)

    def _release(self, job: _Job) -> None:
        """The job no longer counts against its client's caps (once, whatever ended it)."""
        with self._cond:  # reentrant use is not needed: callers never hold it
            if job.released:
                return
            job.released = True
            self._pending[job.client] -= 1
            if self._pending[job.client] <= 0:
                del self._pending[job.client]
            if job.running:
                self._running[job.client] -= 1
                if self._running[job.client] <= 0:
                    del self._running[job.client]
            self._cond.notify_all()
