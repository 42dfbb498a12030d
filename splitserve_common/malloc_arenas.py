"""glibc's allocator as a render server wants it: one malloc arena, and the heap on transparent huge pages.

glibc hands a thread that allocates while another holds the main arena an arena of its own (up to 8 per core).
A render server has two busy threads, the event loop and the bulk lane that renders large bodies
(``render_service/http/render_queue.py``), and their work is serialised by the GIL anyway; with one arena a
cold 128k-token render on the bulk lane cost about 7% less server CPU (``bench/agent_render_bench.py``'s
unrelated conversations, ``docs/operations.md``). An operator's own ``MALLOC_ARENA_MAX`` or
``glibc.malloc.arena_max`` tunable is left to decide.

A render server keeps what it decodes and tokenizes (the message memo, the piece cache, the prompt store), so
until those fill their bounds every new conversation takes fresh memory, a page fault per 4 KiB. With
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` glibc asks for transparent huge pages for its heap and a render
costs 2-9% less server CPU (``docs/bench.md``). glibc reads tunables only when a process starts, so the command
line's ``serve`` starts over once with it set, unless the environment sets ``GLIBC_TUNABLES`` itself (the
operator's choice, an empty value included) or the kernel has transparent huge pages off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _operator_chose_arenas() -> bool:
    return "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", "")


@functools.cache
def _on_glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"  # (reads the interpreter's binary: once per process)


def limit_to_one_arena() -> str:
    """Caps glibc's arenas at one, before this process starts its threads; says what it did (for the log)."""
    if not _on_glibc():
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


def transparent_huge_pages_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise, never); None where it has none."""
    try:
        with open(_THP_MODE) as mode:
            text = mode.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else None


def heap_pages() -> str:
    """What this process's heap runs on, for the log."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    if tunables is None:
        return "heap on 4 KiB pages"
    return "heap on huge pages" if HUGE_PAGES_TUNABLE in tunables else "GLIBC_TUNABLES as the environment sets it"


def restart_with_heap_on_huge_pages() -> str:
    """Starts this process over (``os.execve``, the same command line) with glibc's heap on transparent huge pages,
    where glibc is the allocator, the environment has no ``GLIBC_TUNABLES`` of its own and the kernel allows them;
    otherwise says why not (for the log) and returns. Only for a command line's own process, before it starts
    threads or opens sockets: an in-process caller would be replaced."""
    if not _on_glibc():
        return "not glibc: heap pages left as they are"
    if not sys.executable:
        return "no interpreter path to start over with: heap on 4 KiB pages"
    if "GLIBC_TUNABLES" in os.environ:
        return heap_pages()
    mode = transparent_huge_pages_mode()
    if mode is None:
        return "no transparent huge pages here: heap on 4 KiB pages"
    if mode == "never":
        return "transparent huge pages are off in the kernel: heap on 4 KiB pages"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE})
    except OSError as exc:  # (execve returns only when it fails: serve on as it is)
        return f"could not start over with the heap on huge pages ({exc}): heap on 4 KiB pages"
