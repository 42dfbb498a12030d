"""The servers cap glibc's malloc arenas at one (splitserve_common/malloc_arenas.py): checked in fresh processes
by counting the arenas glibc reports after a second thread has allocated."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

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
