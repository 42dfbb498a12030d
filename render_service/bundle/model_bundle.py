"""A model bundle: a Hugging Face model directory as the render tier and the engine see it.

Read: tokenizer.json (required), tokenizer_config.json, config.json, generation_config.json, and a chat
template from ``chat_template.jinja`` (wins, as in transformers), ``chat_template.json`` or
tokenizer_config's ``chat_template`` (a string, or a list of ``{"name", "template"}``), plus named
templates in ``additional_chat_templates/*.jinja``. Weights are the engine's business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from render_service.tokenize.tokenizer import TextTokenizer, TokenizerError


class BundleError(ValueError):
    """The directory is not a usable model bundle."""


# The tokenizer attributes HF's apply_chat_template passes to templates as variables.
TEMPLATE_SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

# Config keys that bound the context window, as vLLM reads them; the smallest present wins.
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
    "max_seq_length", "seq_len",
)
_DEFAULT_CONTEXT = 2048  # vLLM's choice when a config names no length
# transformers writes int(1e30) when a tokenizer has no real limit; anything this large is not a limit.
_INSANE_MODEL_MAX_LENGTH = 1 << 40


@dataclass
class ModelBundle:
    path: Path
    tokenizer: TextTokenizer
    tokenizer_config: dict[str, Any]
    config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0
    # Named templates (HF allows several; "default" is the one used when none is asked for).
    chat_templates: dict[str, str] = field(default_factory=dict)
    # bos_token, eos_token, ... as apply_chat_template passes them to templates.
    template_special_tokens: dict[str, str] = field(default_factory=dict)
    # sha256 of tokenizer.json's bytes, for the configuration fingerprint.
    tokenizer_sha256: str = ""


def _read_json_object(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise BundleError(f"{path.parent} has no {path.name}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BundleError(f"{path} is not a JSON object")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not readable UTF-8 text: {exc}") from exc


def _named_templates(value: Any, source: Path) -> dict[str, str]:
    """HF's two shapes of ``chat_template``: one string, or a list of {"name", "template"}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise BundleError(f"chat_template in {source} is neither a string nor a list of {{name, template}}")


def load_chat_templates(root: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    templates = _named_templates(tokenizer_config.get("chat_template"), root / "tokenizer_config.json")
    json_file = root / "chat_template.json"
    if json_file.exists():
        templates.update(_named_templates(_read_json_object(json_file).get("chat_template"), json_file))
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = _read_text(path)
    if (root / "chat_template.jinja").exists():
        templates["default"] = _read_text(root / "chat_template.jinja")
    return templates


def _token_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def derive_eos_token_ids(generation_config: dict[str, Any], config: dict[str, Any], tokenizer_config: dict[str, Any],
                         tokenizer: TextTokenizer) -> list[int]:
    """generation_config's EOS IDs, else config's, else the ID of tokenizer_config's eos_token."""
    for source in (generation_config, config, config.get("text_config") or {}):
        ids = _token_ids(source.get("eos_token_id"))
        if ids:
            return list(dict.fromkeys(ids))
    eos = _token_content(tokenizer_config.get("eos_token"))
    eos_id = tokenizer.token_to_id(eos) if eos else None
    return [eos_id] if eos_id is not None else []


def derive_max_model_len(config: dict[str, Any], tokenizer_config: dict[str, Any], override: int | None = None) -> int:
    """The explicit override, else the config's context length capped by a sane model_max_length."""
    if override is not None and override != 0:  # 0 meant "unset" to the first loader
        if isinstance(override, bool) or not isinstance(override, int) or override < 0:
            raise BundleError(f"max_model_len must be a positive integer, not {override!r}")
        return override
    scope = config.get("text_config") or config
    lengths = [v for k in _CONTEXT_LENGTH_KEYS if isinstance(v := scope.get(k), int) and v > 0]
    context = min(lengths) if lengths else _DEFAULT_CONTEXT
    limit = tokenizer_config.get("model_max_length")
    if isinstance(limit, (int, float)) and 0 < limit < min(context, _INSANE_MODEL_MAX_LENGTH):
        context = int(limit)
    return context


def template_special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in TEMPLATE_SPECIAL_TOKEN_NAMES:
        content = _token_content(tokenizer_config.get(name))
        if content is not None:
            tokens[name] = content
    return tokens


def load_bundle(path: str | Path, max_model_len: int | None = None, *, fast_tokenizer: bool = True,
                tokenizer_path: str | Path | None = None) -> ModelBundle:
    """The bundle in ``path``; the tokenizer, its config and the chat templates from ``tokenizer_path`` when
    given (vLLM's --tokenizer), config.json and generation_config.json from ``path`` either way."""
    root = Path(path)
    tok_root = Path(tokenizer_path) if tokenizer_path is not None else root
    for directory in dict.fromkeys([root, tok_root]):
        if not directory.is_dir():
            raise BundleError(f"{directory} is not a directory")
    tokenizer_file = tok_root / "tokenizer.json"
    if not tokenizer_file.exists():
        raise BundleError(f"{tok_root} has no tokenizer.json")
    tok_cfg = _read_json_object(tok_root / "tokenizer_config.json")
    config = _read_json_object(root / "config.json")
    gen_cfg = _read_json_object(root / "generation_config.json")
    try:
        tokenizer = TextTokenizer.from_file(tokenizer_file, tok_cfg, fast=fast_tokenizer)
    except TokenizerError as exc:
        raise BundleError(f"{tokenizer_file}: {exc}") from exc
    response_template = tok_cfg.get("response_template")
    tokenizer.response_template = response_template if isinstance(response_template, dict) else None
    templates = load_chat_templates(tok_root, tok_cfg)
    return ModelBundle(
        path=root,
        tokenizer=tokenizer,
        tokenizer_config=tok_cfg,
        config=config,
        generation_config=gen_cfg,
        chat_template=templates.get("default"),
        eos_token_ids=derive_eos_token_ids(gen_cfg, config, tok_cfg, tokenizer),
        max_model_len=derive_max_model_len(config, tok_cfg, max_model_len),
        chat_templates=templates,
        template_special_tokens=template_special_tokens(tok_cfg),
        tokenizer_sha256=tokenizer.sha256 or "",
    )
