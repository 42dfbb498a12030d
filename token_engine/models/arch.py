"""ModelArch: the shape and switches of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from token_engine.layers.blocks import RopeSpec, rope_spec_from_config

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of bfloat16, float16, float32")
    return DTYPES[name]


@dataclass
class ModelArch:
    """Everything the engine needs to know about a model's shape; the rest of config.json stays behind."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=lambda: RopeSpec(theta=10000.0))
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q, k and v projections (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    sliding_window: int | None = None  # Mistral: every layer attends to the last `sliding_window` positions

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def _eos_ids(*values) -> list[int]:
    ids: list[int] = []
    for value in values:
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return ids


def arch_from_config(config: dict, generation_config: dict | None = None, dtype=None) -> ModelArch:
    """Builds a ModelArch from config.json (and generation_config.json for EOS ids) of a supported model."""
    from token_engine.models import resolve_model_type

    model_type = resolve_model_type(config)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attention_bias = bool(config.get("attention_bias", False))
    sliding_window = None
    if model_type == "mistral":
        sliding_window = config.get("sliding_window")
    elif config.get("use_sliding_window"):
        raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
    gen = generation_config or {}
    return ModelArch(
        model_type=model_type,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        dtype=parse_dtype(dtype or config.get("torch_dtype") or config.get("dtype")),
        eos_token_ids=_eos_ids(gen.get("eos_token_id"), config.get("eos_token_id")),
        bos_token_id=gen.get("bos_token_id", config.get("bos_token_id")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_spec_from_config(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
    )


def read_arch(model_dir: str | Path, dtype=None) -> ModelArch:
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return arch_from_config(config, gen, dtype)


def read_eos_token_ids(model_dir: str | Path, generation_config: str = "auto") -> list[int]:
    """EOS ids as vLLM's --generation-config picks them: "auto" adds the model's generation_config.json to
    config.json's, "vllm" takes config.json's alone, any other value is the directory of the file to use."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    gen: dict = {}
    if generation_config != "vllm":
        path = Path(model_dir if generation_config == "auto" else generation_config) / "generation_config.json"
        if generation_config != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {generation_config}: no generation_config.json there")
        gen = json.loads(path.read_text()) if path.is_file() else {}
    return _eos_ids(gen.get("eos_token_id"), config.get("eos_token_id"))
