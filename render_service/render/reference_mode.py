"""The reference switch: every render acceleration off, so the plain path can be served and compared.

``--reference-render`` (or ``SPLITSERVE_REFERENCE_RENDER=1``) turns off, for the whole process, what makes a
render fast without changing its answer: the render caches (the piece cache and prompt store, the message memo
and its body store: ``--render-cache-bytes 0``), the ``tojson`` text cache and its lending, the fast tokenizer
paths (fastokens and tiktoken: ``tokenizers`` encodes) and the direct HTTP path (every request through ASGI).
Every fast path already proves itself equal to its plain path at load; this switch is what a differential test
or an operator chasing a suspected fault compares against.
"""

from __future__ import annotations

import os

REFERENCE_ENV = "SPLITSERVE_REFERENCE_RENDER"
_TRUE = frozenset({"1", "true", "yes", "on"})


def reference_render() -> bool:
    """True when the process renders on the plain path only (read where each acceleration is built)."""
    return os.environ.get(REFERENCE_ENV, "").strip().lower() in _TRUE


def set_reference_render(on: bool) -> None:
    """Turns the switch on or off for what is built from now on (the CLI sets it before loading)."""
    os.environ[REFERENCE_ENV] = "1" if on else "0"
