"""Result files say what a reader elsewhere can use: no path of the machine a bench ran on.

``portable`` rewrites the absolute paths a run records (its interpreter, the checkouts it compared, the peers'
virtual environments, temporary model directories, output folders) into names that mean the same thing on any
machine: ``python``, ``<checkout>``, ``<vLLM 0.33 venv>``, ``shared/fixtures/...``. Every bench applies it to
what it writes (``write_result``); ``tests/test_bench_results_portable.py`` holds bench/results to it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# Result fields whose value is another checkout of this repository.
CHECKOUT_KEYS = ("tree", "baseline_tree", "compare_tree", "main", "this", "base", "before", "after")
_ROOTS = r"(?:/work|/tmp|/root|/home|/var|/opt|/mnt|/data)"
_PATH_CHARS = r"[^\s\"',;)\]]"

# Ordered: the specific meanings first, then any other absolute path under a machine's own directories.
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(rf"{_PATH_CHARS}*/\.venv/bin/python[0-9.]*"), "python"),
    (re.compile(rf"{_PATH_CHARS}*/vllm/vllm-rs\b"), "<vllm-rs>"),
    (re.compile(rf"{_ROOTS}/{_PATH_CHARS}*?vllm0?(\d)(\d\d)\b{_PATH_CHARS}*"), r"<vLLM \1.\2 venv>"),
    (re.compile(rf"{_ROOTS}{_PATH_CHARS}*?/shared/fixtures\b"), "shared/fixtures"),
    (re.compile(rf"{_ROOTS}{_PATH_CHARS}*?/\.cache/"), "~/.cache/"),
    (re.compile(r"/tmp/tmp[\w.]*(?:/\w+)?"), "<temporary model dir>"),
    (re.compile(r"(?:/tmp/seed|/tmp/out|/root/out)\b"), "$OUT"),
    (re.compile(rf"{_ROOTS}/{_PATH_CHARS}*?/(render_service|token_engine|bench)\b"), r"<checkout>/\1"),
    # another checkout compared with this one: a flag's value, or a result's field naming it
    (re.compile(rf"(--(?:ab|baseline|compare)-tree[ =]|--tree \w+=|\w+=(?={_ROOTS}/))({_ROOTS}/{_PATH_CHARS}*)"),
     r"\1<checkout>"),
    (re.compile(rf'("(?:{"|".join(CHECKOUT_KEYS)})": ")({_ROOTS}/{_PATH_CHARS}*)'), r"\1<checkout>"),
    (re.compile(rf"{_ROOTS}/{_PATH_CHARS}*"), "<local path>"),
]


_ABSOLUTE = re.compile(_ROOTS + "/")


def portable_text(text: str) -> str:
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def portable(value: Any) -> Any:
    """``value`` (JSON-shaped) with every string's machine paths rewritten."""
    if isinstance(value, str):
        return portable_text(value)
    if isinstance(value, dict):
        return {portable(k): "<checkout>" if k in CHECKOUT_KEYS and isinstance(v, str) and _ABSOLUTE.match(v)
                else portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    return value


def write_result(path: str | Path, result: Any) -> Path:
    """Writes ``result`` as indented JSON, its paths made portable; the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(portable(result), indent=2) + "\n")
    return out
