"""One malloc arena for the whole process, on glibc.

glibc hands a thread that allocates while another holds the main arena an arena of its own (up to 8 per core).
A render server has two busy threads, the event loop and the bulk lane that renders large bodies
(``render_service/http/render_queue.py``), and their work is serialised by the GIL anyway; with one arena a
cold 128k-token render on the bulk lane cost about 7% less server CPU (``bench/agent_render_bench.py``'s
unrelated conversations, ``docs/operations.md``). An operator's own ``MALLOC_ARENA_MAX`` or
``glibc.malloc.arena_max`` tunable is left to decide.
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def _operator_chose_arenas() -> bool:
    return "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", "")


def limit_to_one_arena() -> str:
    """Caps glibc's arenas at one, before this process starts its threads; says what it did (for the log)."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc: allocator left as it is"
    if _operator_chose_arenas():
        return "arenas as the environment sets them"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "mallopt not found: allocator left as it is"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return "one malloc arena" if mallopt(_M_ARENA_MAX, 1) == 1 else "mallopt refused: allocator left as it is"
