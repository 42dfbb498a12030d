"""Argument types shared by the render tier's and the engine's command lines."""

from __future__ import annotations

import argparse
import json
from typing import Any


def json_object_arg(text: str) -> dict[str, Any]:
    """An argparse type: the flag's value must be a JSON object (vLLM's --kv-transfer-config and friends)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
