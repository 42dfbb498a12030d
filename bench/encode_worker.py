"""A tokenizer in a process of its own, for baselines measured like a server's request.

A render server waits idle between requests while the other servers of a benchmark run, and starts each one
with cold caches; an encode timed in a warm loop (best of several, in the benchmark's own process) is not
the same measurement. This worker sits idle the same way: it reads a text from stdin, encodes it once and
answers with the thread CPU nanoseconds of that encode alone and the token count.

Protocol: the parent writes 8 bytes of little-endian length then the UTF-8 text; the worker answers 16 bytes
(CPU ns, token count). It prints ``ready`` once loaded.

Kinds: ``ours`` (TextTokenizer.encode, the path our server takes: fastokens where it qualifies), ``tiktoken``
(TextTokenizer held to the tiktoken path, what ours was before fastokens), ``tokenizers`` (Hugging Face's).

usage: python -m bench.encode_worker TOKENIZER_JSON {ours|tiktoken|tokenizers}
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

from bench import peers


def serve(tokenizer_json: str, kind: str) -> int:
    import os

    if kind == "tiktoken":
        os.environ["SPLITSERVE_TOKENIZER_BACKEND"] = "tiktoken"
    from render_service.tokenize.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_file(tokenizer_json)
    encode = tokenizer.encode if kind in ("ours", "tiktoken") else (
        lambda text: tokenizer.hf.encode(text, add_special_tokens=False).ids)
    encode("warm up the first call")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return 0
        text = stdin.read(struct.unpack("<Q", head)[0]).decode("utf-8")
        started = time.thread_time_ns()
        ids = encode(text)
        spent = time.thread_time_ns() - started
        stdout.write(struct.pack("<QQ", spent, len(ids)))
        stdout.flush()


class EncodeWorker:
    """The parent's handle on one worker process."""

    def __init__(self, tokenizer_json: Path, kind: str) -> None:
        self.kind = kind
        self.process = subprocess.Popen([sys.executable, "-m", "bench.encode_worker", str(tokenizer_json), kind],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=peers.REPO)
        assert self.process.stdout is not None
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"encode worker ({kind}) did not start")

    def encode_ms(self, text: str) -> tuple[float, int]:
        """(CPU ms of one encode of ``text`` in the worker, token count)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        data = text.encode("utf-8")
        self.process.stdin.write(struct.pack("<Q", len(data)) + data)
        self.process.stdin.flush()
        spent, count = struct.unpack("<QQ", self.process.stdout.read(16))
        return spent / 1e6, count

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2]))
