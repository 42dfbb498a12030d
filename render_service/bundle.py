"""A model bundle: a Hugging Face model directory as the render tier and the engine see it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from render_service.tokenizer import TextTokenizer


class BundleError(ValueError):
    """The directory is not a usable model bundle."""


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass
class ModelBundle:
    path: Path
    tokenizer: TextTokenizer
    tokenizer_config: dict
    config: dict
    generation_config: dict
    chat_template: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0


def load_bundle(path: str | Path, max_model_len: int | None = None) -> ModelBundle:
    root = Path(path)
    if not (root / "tokenizer.json").exists():
        raise BundleError(f"{root} has no tokenizer.json")
    tok_cfg = _read_json(root / "tokenizer_config.json")
    config = _read_json(root / "config.json")
    gen_cfg = _read_json(root / "generation_config.json")
    tokenizer = TextTokenizer.from_file(root / "tokenizer.json", tok_cfg)
    template = tok_cfg.get("chat_template")
    if (root / "chat_template.jinja").exists():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    eos = gen_cfg.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    context = max_model_len or config.get("max_position_embeddings") or 2048
    return ModelBundle(root, tokenizer, tok_cfg, config, gen_cfg, template, eos_ids, int(context))
