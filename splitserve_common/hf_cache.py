"""A model argument as vLLM takes it: a local directory, or a Hugging Face model id (``Qwen/Qwen3-0.6B``)
found in the local hub cache, else downloaded through ``huggingface_hub`` when a hub is reachable.

The cache is the hub's own layout, read here without huggingface_hub so that the render tier resolves a
cached model offline and without the package: ``<cache>/models--Org--Name/refs/<revision>`` holds a commit
hash, ``snapshots/<hash>/`` the files. The cache directory is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``). ``HF_HUB_OFFLINE=1`` never downloads;
``HF_ENDPOINT`` names a hub mirror.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# What each tier needs from a repository: render reads the tokenizer, templates and configs; the engine
# also the weights. Nothing else (other weight formats, images, READMEs) is fetched.
TOKENIZER_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
WEIGHT_FILES = [*TOKENIZER_FILES, "*.safetensors"]

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "true", "yes", "on"}


class ModelNotFound(ValueError):
    """The argument names neither a directory nor a model the cache (or the hub) has; one line for the CLI."""


@dataclass(frozen=True)
class ResolvedModel:
    directory: str  # where config.json, the tokenizer and the weights are
    name: str  # the argument as given: vLLM serves a model under exactly that name by default
    from_hub: bool  # resolved from a model id (cache or download), not a local directory


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    values = _environ(env)
    if values.get("HF_HUB_CACHE"):
        return Path(values["HF_HUB_CACHE"]).expanduser()
    if values.get("HF_HOME"):
        return Path(values["HF_HOME"]).expanduser() / "hub"
    xdg = values.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def hub_offline(env: Mapping[str, str] | None = None) -> bool:
    values = _environ(env)
    return any(values.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.startswith(".")


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` (a branch, tag or commit) in the cache, or None."""
    repo = (cache_dir or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    commit = revision if _COMMIT.fullmatch(revision) else None
    if commit is None:
        ref = repo / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text(encoding="utf-8").strip()
        if not _COMMIT.fullmatch(commit):
            return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def resolve_model(model: str, revision: str | None = None, *, weights: bool = True,
                  env: Mapping[str, str] | None = None) -> ResolvedModel:
    """A local directory as is; else a model id from the cache, else downloaded (ModelNotFound otherwise)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return ResolvedModel(str(path), model, False)
    if path.exists():
        raise ModelNotFound(f"model {model!r} is a file, not a model directory")
    if not looks_like_repo_id(model) or model.startswith(("/", "~")):
        raise ModelNotFound(f"model directory {model} does not exist")
    cache = hub_cache_dir(env)
    snapshot = cached_snapshot(model, revision, cache)
    where = f"{model}" + (f" (revision {revision})" if revision else "")
    # A snapshot the render tier fetched holds no weights: the engine completes it when it can.
    complete = snapshot is not None and (not weights or any(snapshot.glob("*.safetensors")))
    if snapshot is not None and (complete or hub_offline(env)):
        return ResolvedModel(str(snapshot), model, True)
    if hub_offline(env):
        raise ModelNotFound(f"{where} is neither a directory nor in the Hugging Face cache {cache}, and "
                            f"HF_HUB_OFFLINE is set (set HF_HUB_CACHE or HF_HOME to the cache that holds it)")
    endpoint = _environ(env).get("HF_ENDPOINT")  # a mirror; read now, not at import
    return ResolvedModel(_download(model, revision, cache, weights, where, endpoint), model, True)


def _download(repo_id: str, revision: str | None, cache: Path, weights: bool, where: str,
              endpoint: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFound(f"{where} is not in the Hugging Face cache {cache}, and huggingface_hub (needed to "
                            f"download it) is not installed") from None
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=str(cache), endpoint=endpoint,
                                 allow_patterns=WEIGHT_FILES if weights else TOKENIZER_FILES)
    except Exception as exc:  # noqa: BLE001 - no network, unknown repo, gated model: one line either way
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFound(f"{where} is not in the Hugging Face cache {cache} and could not be downloaded: "
                            f"{detail}") from None
