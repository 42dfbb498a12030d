"""Model definitions and `load_model`: a Hugging Face model directory -> a CausalLM on a device.

A CausalLM has `.arch` (ModelArch), `forward(input_ids [T], positions [T], meta, kv_pool) -> hidden [T, H]` and
`compute_logits(hidden [N, H]) -> [N, vocab] float32`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from token_engine.models.arch import ModelArch, arch_from_config, parse_dtype, read_arch
from token_engine.models.llama import LlamaForCausalLM

CausalLM = LlamaForCausalLM

# config.json "architectures" entry -> model class; model_type is the fallback
ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ModelArch",
    "arch_from_config",
    "build_model",
    "load_model",
    "read_arch",
    "resolve_model_type",
]


def resolve_model_type(config: dict) -> str:
    """The variant a config describes: from `model_type` when known, else from `architectures`."""
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    for name in config.get("architectures") or []:
        if name in MODEL_TYPES:
            return MODEL_TYPES[name]
    raise ValueError(
        f"unsupported model: model_type={model_type!r} architectures={config.get('architectures')!r}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def build_model(arch: ModelArch, device: str | torch.device = "cpu") -> CausalLM:
    """An uninitialized model on `device` (parameters allocated, not filled: load or randomize them next)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def load_model(model_dir: str | Path, dtype=None, device: str | torch.device = "cpu") -> CausalLM:
    from token_engine.models.loader import iter_checkpoint

    arch = read_arch(model_dir, dtype=parse_dtype(dtype) if dtype is not None else None)
    model = build_model(arch, device)
    loaded = model.load_weights(iter_checkpoint(model_dir, arch.dtype))
    missing = model.expected_checkpoint_names() - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return model
