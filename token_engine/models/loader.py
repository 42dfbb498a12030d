"""Reads Hugging Face safetensors checkpoints by tensor name: one file, or shards listed in an index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, else model.safetensors, else *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            path = (model_dir / shard).resolve()
            if path.parent != model_dir.resolve():
                raise ValueError(f"index names a shard outside the model directory: {shard!r}")
            files.append(path)
        if not files:
            raise ValueError(f"{index} has an empty weight_map")
        return files
    if (model_dir / SINGLE_NAME).exists():
        return [model_dir / SINGLE_NAME]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: str | Path, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint, cast to `dtype` when given, on CPU."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield name, tensor
