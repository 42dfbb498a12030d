"""What a grammar-compile worker process does (forked by zygote.py), and the messages it exchanges.

xgrammar cannot interrupt a compile, so compiles run in a process the engine kills when one takes too long
(pool.py). The engine sends one spec per message; each answer is the compiled grammar serialized by
xgrammar (b"G" + JSON), which the engine deserializes against the same vocabulary, or an error message for
the client (b"E" + text). Messages are multiprocessing.connection frames on a socket.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import struct
from multiprocessing.connection import Connection

from token_engine.structured.spec import GrammarError, GuideSpec

READY = b"R"
FORK = b"F"  # zygote control: fork a worker on the socket passed along (SCM_RIGHTS); the answer is PID
PID = struct.Struct("!q")
GRAMMAR = b"G"
ERROR = b"E"
_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix
_PR_SET_PDEATHSIG = 1


def library_message(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LIBRARY_PREFIX.sub("", text.splitlines()[0]).strip()


def choice_grammar(choices: list[str]) -> str:
    """EBNF that matches exactly one of the choices (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def encode_job(spec: GuideSpec) -> bytes:
    return json.dumps([spec.kind, spec.value, spec.any_whitespace]).encode()


def compile_spec(compiler, spec: GuideSpec):
    """spec compiled by an xgrammar.GrammarCompiler; GrammarError with the library's message on failure."""
    try:
        return _compile_spec(compiler, spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's own message is the client's answer
        raise GrammarError(f"structured_outputs.{spec.kind}: {library_message(exc)}") from None


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


def die_with_parent() -> None:
    """The kernel kills this process when its parent dies, even mid-compile (Linux only)."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def serve(channel: Connection, compiler) -> None:
    """A worker's loop on its channel: one spec in, one answer out, until the engine closes the channel."""
    while True:
        try:
            kind, value, any_whitespace = json.loads(channel.recv_bytes())
        except (EOFError, OSError):
            return
        spec = GuideSpec(kind, value, any_whitespace)
        try:
            reply = GRAMMAR + compile_spec(compiler, spec).serialize_json().encode()
        except GrammarError as exc:
            reply = ERROR + exc.message.encode()
        channel.send_bytes(reply)
