"""Bounds on what one request may carry, beyond the body size (64 MiB on every server) and the context
window: a body under the size cap can still hold a million tiny messages or a deeply nested
``kv_transfer_params``, and each costs CPU in the template or the engine before any other check runs.

The functions return ``(message, param)`` for a violation, else None, so each server raises its own
4xx error type. Every bound is far above real use (vLLM sets none of these; OpenAI allows 128 tools).
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGES = 16384
MAX_TOOLS = 2048
MAX_PROMPTS = 4096  # prompts in one /v1/completions batch
MAX_KV_PARAMS_KEYS = 64
MAX_KV_PARAMS_KEY_CHARS = 128
MAX_KV_PARAMS_STRING_CHARS = 4096
MAX_KV_PARAMS_LIST_ITEMS = 1 << 20  # remote_block_ids / prompt_token_ids of a long context


def chat_limit_violation(num_messages: int, num_tools: int) -> tuple[str, str] | None:
    if num_messages > MAX_MESSAGES:
        return f"messages holds {num_messages} entries; at most {MAX_MESSAGES} are accepted.", "messages"
    if num_tools > MAX_TOOLS:
        return f"tools holds {num_tools} entries; at most {MAX_TOOLS} are accepted.", "tools"
    return None


def prompts_limit_violation(num_prompts: int) -> tuple[str, str] | None:
    if num_prompts > MAX_PROMPTS:
        return f"prompt holds {num_prompts} prompts; at most {MAX_PROMPTS} are accepted in one request.", "prompt"
    return None


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (
        isinstance(value, str) and len(value) <= MAX_KV_PARAMS_STRING_CHARS)


def kv_transfer_params_violation(params: Any) -> tuple[str, str] | None:
    """kv_transfer_params must be a flat object: scalar values, short strings, lists of scalars, or one
    level of nested lists (vLLM's per-KV-group remote_block_ids). Connector-specific keys pass; their
    meaning is checked by the connector that reads them."""
    param = "kv_transfer_params"
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params must be an object.", param
    if len(params) > MAX_KV_PARAMS_KEYS:
        return f"kv_transfer_params holds {len(params)} keys; at most {MAX_KV_PARAMS_KEYS} are accepted.", param
    for key, value in params.items():
        where = f"{param}.{key}"[: MAX_KV_PARAMS_KEY_CHARS + len(param) + 1]
        if len(key) > MAX_KV_PARAMS_KEY_CHARS:
            return f"kv_transfer_params keys are at most {MAX_KV_PARAMS_KEY_CHARS} characters.", param
        if _scalar(value):
            continue
        if not isinstance(value, list):
            return f"{where} must be a number, a string of at most {MAX_KV_PARAMS_STRING_CHARS} characters, " \
                   "null or a list.", where
        items = [x for group in value for x in group] if value and all(isinstance(g, list) for g in value) \
            else value
        if len(items) > MAX_KV_PARAMS_LIST_ITEMS or not all(_scalar(x) for x in items):
            return f"{where} must be a list (or a list of lists) of at most {MAX_KV_PARAMS_LIST_ITEMS} scalars.", where
    return None
