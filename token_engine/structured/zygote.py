"""`python -m token_engine.structured.zygote CONTROL_FD`: forks grammar-compile workers on request.

A fresh interpreter would import xgrammar (and with it torch) again for every worker: 5-20 s on a busy
machine, which is how long a killed worker's slot would stay empty. This process pays for that once: it
imports xgrammar, reads the vocabulary the engine sends (xgrammar's TokenizerInfo JSON) and then, for each
socket the engine passes it (SCM_RIGHTS), forks a worker that serves compiles on that socket (worker.py)
and answers the worker's pid, so the engine can kill that worker. It never runs a compile or a thread
itself, so forking is safe. It ends when the engine's end of the control socket closes (the engine exited
or closed its pool); its workers die with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

from token_engine.structured import worker


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine decides
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel when killed
    # No PR_SET_PDEATHSIG here: it fires when the engine *thread* that started this process ends. The
    # control socket's EOF ends this process instead; only workers (children of this one thread) use it.
    channel = Connection(os.dup(control.fileno()))
    try:
        import xgrammar

        info = xgrammar.TokenizerInfo.deserialize_json(channel.recv_bytes().decode())
    except EOFError:
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which answers every spec with it
        channel.send_bytes(worker.ERROR + f"structured_outputs: the grammar compiler did not start: "
                                          f"{worker.library_message(exc)}".encode())
        return 1
    channel.send_bytes(worker.READY)
    channel.close()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return 0
        if message != worker.FORK or len(fds) != 1:
            return 0  # the engine closed its end (or spoke nonsense): stop
        pid = os.fork()
        if pid == 0:  # the worker
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            worker.die_with_parent()
            compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the engine caches
            worker.serve(Connection(fds[0]), compiler)
            os._exit(0)
        os.close(fds[0])
        control.sendall(worker.PID.pack(pid))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
