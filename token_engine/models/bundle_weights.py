"""Random weights for a weightless model bundle (the render tier's built-in default bundle has tokenizer,
chat template and config only): ``token-engine with-random-weights BUNDLE_DIR`` prints the directory of a
cached copy of the bundle plus random bfloat16 safetensors (seed 0) shaped by the bundle's own config.json.

The copy sits beside the bundle, named after a hash of the bundle's config and of the weight writer, and
is built once (build-then-rename, so concurrent callers are harmless)."""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import resources
from pathlib import Path

from splitserve_common.cache_dir import build_once


def _content_key(bundle: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in bundle.iterdir() if p.is_file()):
        h.update(name.encode() + b"\0" + (bundle / name).read_bytes() + b"\0")
    h.update(resources.files("token_engine.models").joinpath("random_model.py").read_bytes())
    return h.hexdigest()[:16]


def with_random_weights(bundle_dir: str | Path, seed: int = 0) -> Path:
    """The cached copy of ``bundle_dir`` with random weights, built first if needed."""
    from token_engine.models.random_model import write_random_weights

    bundle = Path(bundle_dir)
    if any(bundle.glob("*.safetensors")):
        return bundle
    config = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    final = bundle.parent / f"{bundle.name}-weights-{_content_key(bundle)}"

    def write(tmp: Path) -> None:
        for path in bundle.iterdir():
            if path.is_file():
                shutil.copyfile(path, tmp / path.name)
        write_random_weights(tmp, config, seed=seed, dtype="bfloat16")

    return build_once(final, write)
