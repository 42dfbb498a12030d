"""Chat requests that arrive already rendered, so nothing renders them twice.

A router that rendered a request for prefix-aware routing passes the token ids on, and the gateway (or a
render endpoint) uses them instead of applying the chat template and tokenizing again:
- vLLM's channel (vllm#48145): ``kv_transfer_params.prompt_token_ids``; the key is removed before the
  parameters reach an engine. ``messages`` and ``tools`` still drive validation, parsers and the response.
- ours: the same ids plus the fingerprint our render tier stamped on its ``GenerateRequest``
  (``kv_transfer_params.render_fingerprint`` or the ``x-render-fingerprint`` header it answered with). A
  fingerprint that is not this server's is refused: those ids came from another tokenizer or template.
The ids are client input like a completions prompt's: checked against the vocabulary and the context.
"""

from __future__ import annotations

from typing import Any

from render_service.http.errors import bad_request
from render_service.render.render_config import RenderConfig

PROMPT_IDS_KEY = "prompt_token_ids"
FINGERPRINT_KEY = "render_fingerprint"
RENDER_KEYS = frozenset({PROMPT_IDS_KEY, FINGERPRINT_KEY})


def prerendered_prompt_ids(kv_transfer_params: dict[str, Any] | None, config: RenderConfig,
                           fingerprint_header: str | None = None) -> list[int] | None:
    """The prompt's ids when the request carries them (checked), else None."""
    if not kv_transfer_params or PROMPT_IDS_KEY not in kv_transfer_params:
        return None
    param = f"kv_transfer_params.{PROMPT_IDS_KEY}"
    ids = kv_transfer_params[PROMPT_IDS_KEY]
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise bad_request(f"{param} must be a non-empty list of token ids", param)
    vocab = config.tokenizer.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise bad_request(f"Token id {bad} is out of vocabulary", param)
    fingerprint = kv_transfer_params.get(FINGERPRINT_KEY, fingerprint_header)
    if fingerprint is not None and fingerprint != config.fingerprint:
        raise bad_request(
            f"{param} were rendered under render fingerprint {str(fingerprint)[:64]!r}, but this server's is "
            f"{config.fingerprint!r} (another tokenizer, chat template or parser configuration); send the "
            "request without them to render it here",
            f"kv_transfer_params.{FINGERPRINT_KEY}")
    return list(ids)


def engine_kv_params(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """What of ``kv_transfer_params`` an engine gets: the render keys removed (None when nothing is left)."""
    if not kv_transfer_params:
        return None
    rest = {k: v for k, v in kv_transfer_params.items() if k not in RENDER_KEYS}
    return rest or None
