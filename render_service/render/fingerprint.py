"""A short hash of everything that decides how text and token IDs map to each other.

Render and derender may run in different processes, replicas or releases. If one tier's tokenizer,
chat template, parser flags or default template kwargs differ from the other's, derender would
silently split content, reasoning and tool calls differently. Render stamps this fingerprint on its
output; derender compares it when the caller passes it back and refuses a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

FINGERPRINT_HEADER = "x-render-fingerprint"
# Bumped when the meaning of a fingerprint input changes.
FINGERPRINT_VERSION = "fp1"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_fingerprint(
    *,
    tokenizer_sha256: str,
    chat_template: str | None,
    reasoning_parser: str | None,
    tool_call_parser: str | None,
    enable_auto_tool_choice: bool,
    default_chat_template_kwargs: dict[str, Any] | None,
    response_template: dict[str, Any] | None = None,
) -> str:
    """``fp1-`` plus 16 hex digits of sha256 over a canonical JSON of the inputs. ``response_template``: the
    bundle's, where a parser reads it (hf, beam); absent otherwise, so other fingerprints stay as they were."""
    inputs: dict[str, Any] = {
        "tokenizer_sha256": tokenizer_sha256,
        "chat_template": chat_template or "",
        "reasoning_parser": reasoning_parser or "",
        "tool_call_parser": tool_call_parser or "",
        "enable_auto_tool_choice": bool(enable_auto_tool_choice),
        "default_chat_template_kwargs": default_chat_template_kwargs or {},
    }
    if response_template is not None:
        inputs["response_template"] = response_template
    canonical = json.dumps(
        inputs,
        sort_keys=True,
        ensure_ascii=True,
        separators=(",", ":"),
    )
    return f"{FINGERPRINT_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"
