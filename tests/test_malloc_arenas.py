"""glibc's allocator as the render server sets it (splitserve_common/malloc_arenas.py), checked in fresh processes:
one malloc arena (the arenas glibc reports after a second thread has allocated), and the heap on transparent huge
pages (the process started over with glibc's tunable, and the kernel's own account of the heap)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve_common.malloc_arenas import transparent_huge_pages_mode

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

_PROBE = r"""
import ctypes, os, sys, tempfile, threading
from splitserve_common.malloc_arenas import limit_to_one_arena
said = limit_to_one_arena() if sys.argv[1] == "limit" else "untouched"

def allocate():
    kept = [bytearray(10_000) for _ in range(200)]
    return len(kept)

thread = threading.Thread(target=allocate)
thread.start()
thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
fd, path = tempfile.mkstemp()
os.close(fd)
handle = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, handle)
libc.fclose(handle)
with open(path) as report:
    print(said + "|" + str(report.read().count("<heap nr=")))
os.unlink(path)
"""


def arenas_after_a_thread_allocates(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=REPO, env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    said, count = out.rsplit("|", 1)
    return said, int(count)


def test_a_second_thread_gets_an_arena_of_its_own_by_default():
    assert arenas_after_a_thread_allocates("plain") == ("untouched", 2)


def test_the_limit_keeps_every_thread_on_one_arena():
    assert arenas_after_a_thread_allocates("limit") == ("one malloc arena", 1)


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}])
def test_an_operators_own_arena_setting_wins(env):
    assert arenas_after_a_thread_allocates("limit", **env) == ("arenas as the environment sets them", 2)


# --- the heap on transparent huge pages: the command line's process starts over with glibc's tunable set ---

_HEAP_PROBE = r"""
import os, sys
from splitserve_common.malloc_arenas import restart_with_heap_on_huge_pages
said = restart_with_heap_on_huge_pages()
kept = [bytes(3000) for _ in range(5000)]  # ~15 MB from glibc's heap (past pymalloc's small objects)
print(said + "|" + os.environ.get("GLIBC_TUNABLES", "-") + "|" + str(os.getpid()))
from tests.test_malloc_arenas import heap_is_huge_page_eligible
print(heap_is_huge_page_eligible(os.getpid()))
"""


def heap_is_huge_page_eligible(pid: int) -> bool | None:
    """Whether the kernel may back the process's [heap] with huge pages (smaps' THPeligible), None where it does
    not say."""
    eligible = None
    with open(f"/proc/{pid}/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == "[heap]"
            elif inside and fields and fields[0] == "THPeligible:":
                eligible = bool(eligible) or fields[1] == "1"
    return eligible


def heap_probe(before: str = "", **env: str) -> tuple[str, str, bool | None]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", before + _HEAP_PROBE], cwd=REPO, env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().splitlines()
    said, tunables, _ = out[0].split("|")
    return said, tunables, {"True": True, "False": False}.get(out[1])


thp_off = pytest.mark.skipif(transparent_huge_pages_mode() in (None, "never"),
                             reason="the kernel has no transparent huge pages on")


@thp_off
def test_a_process_starts_over_once_with_its_heap_on_huge_pages():
    said, tunables, eligible = heap_probe()
    assert (said, tunables) == ("heap on huge pages", "glibc.malloc.hugetlb=1")
    # (with "always" every heap is eligible anyway)
    if transparent_huge_pages_mode() == "madvise" and eligible is not None:
        assert eligible


@thp_off
def test_a_process_that_cannot_start_over_serves_on_as_it_is():
    """execve failing (here: an interpreter path that does not exist) leaves the process running, on 4 KiB pages,
    and says why."""
    said, tunables, _ = heap_probe("import sys; sys.executable = '/nonexistent/python'\n")
    assert said.startswith("could not start over with the heap on huge pages (") and tunables == "-"


@pytest.mark.parametrize("given", ["", "glibc.malloc.arena_max=4"])
def test_an_operators_own_tunables_are_kept(given):
    said, tunables, eligible = heap_probe(GLIBC_TUNABLES=given)
    assert (said, tunables) == ("GLIBC_TUNABLES as the environment sets it", given)
    if transparent_huge_pages_mode() == "madvise" and eligible is not None:
        assert not eligible


@thp_off
def test_the_render_server_from_the_command_line_runs_with_its_heap_on_huge_pages():
    """`render-service serve` as a command: the same process id, started over with the tunable, serving."""
    import httpx

    from bench.peers import free_port
    from tests.shared_paths import SHARED

    port = free_port()
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-m", "render_service.cli", "serve", str(SHARED / "fixtures/qwen3-0.6b"),
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            cwd=REPO, env=clean, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not answer /health")
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
        if transparent_huge_pages_mode() == "madvise":
            assert heap_is_huge_page_eligible(proc.pid) is not False
    finally:
        proc.terminate()
        proc.wait(timeout=30)
