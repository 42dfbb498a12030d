"""Random-weight model directories of any Llama/Qwen shape, for tests and benchmarks (no hub access).

`write_random_model` writes config.json, generation_config.json and model.safetensors (or shards plus
model.safetensors.index.json) in Hugging Face's layout, so both our loader and `transformers` read them.
`randomize_parameters_` fills an already built model in place (on GPU: no 15 GB file for a 7B benchmark).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from token_engine.models.arch import arch_from_config, parse_dtype

_QWEN_EOS = {"bos_token_id": 151643, "eos_token_id": 151645, "gen_eos": [151645, 151643]}
_LLAMA_EOS = {"bos_token_id": 1, "eos_token_id": 2, "gen_eos": [2]}

# Base config per architecture (a small, valid model of that family).
ARCH_DEFAULTS: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        **_LLAMA_EOS,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "hidden_act": "silu",
        **_LLAMA_EOS,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        **_QWEN_EOS,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        **_QWEN_EOS,
    },
}

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}

# Presets: "tiny" keeps the requested arch; the real shapes fix their own arch.
PRESETS: dict[str, tuple[str | None, dict]] = {
    "tiny": (None, _TINY),
    "qwen2.5-7b": (
        "qwen2",
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-8b": (
        "qwen3",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
        },
    ),
    "llama3-8b": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "gen_eos": [128001, 128008, 128009],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}

_NOT_TOKENIZER_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def random_model_config(arch: str = "qwen3", preset: str = "tiny", overrides: dict | None = None,
                        dtype: str = "bfloat16") -> tuple[dict, dict]:
    """(config.json, generation_config.json) contents for an arch + preset + overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    preset_arch, shape = PRESETS[preset]
    arch = preset_arch or arch
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCH_DEFAULTS)}")
    config = {**ARCH_DEFAULTS[arch], **shape, **(overrides or {})}
    gen_eos = config.pop("gen_eos")
    config["torch_dtype"] = str(parse_dtype(dtype)).removeprefix("torch.")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": gen_eos, "do_sample": False}
    return config, generation


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face checkpoint of this config (unfused q/k/v and gate/up)."""
    arch = arch_from_config(config)
    h, inter, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out_features in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out_features, h)
            if arch.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out_features,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if arch.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if arch.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device="cpu") -> torch.Tensor:
    """A float32 tensor whose scale keeps activations O(1) through the network and logits decisive.

    Norm weights near 1 (not exactly 1, so a skipped or misplaced norm changes the output), projections
    N(0, 1/fan_in), embeddings N(0, 1), biases small.
    """
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if name.endswith("norm.weight"):
        return t.normal_(1.0, 0.1, generator=generator)
    if name.endswith(".bias"):
        return t.normal_(0.0, 0.1, generator=generator)
    if "embed_tokens" in name:
        return t.normal_(0.0, 1.0, generator=generator)
    std = 1.0 / math.sqrt(shape[-1])
    if name == "lm_head.weight":
        std *= 4.0
    return t.normal_(0.0, std, generator=generator)


def write_random_model(out_dir, arch: str = "qwen3", preset: str = "tiny", overrides: dict | None = None,
                       tokenizer_dir=None, seed: int = 0, dtype: str = "bfloat16",
                       max_shard_bytes: int | None = None) -> Path:
    """Writes a random-weight model directory and returns its path.

    `max_shard_bytes` splits the weights into model-0000N-of-0000M.safetensors shards plus an index.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, generation = random_model_config(arch, preset, overrides, dtype)
    write_random_weights(out, config, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is not None:
        for path in Path(tokenizer_dir).iterdir():
            if path.is_file() and path.name not in _NOT_TOKENIZER_FILES and not path.name.endswith(".safetensors"):
                shutil.copyfile(path, out / path.name)
    return out


def write_random_weights(out: Path, config: dict, seed: int = 0, dtype: str = "bfloat16",
                         max_shard_bytes: int | None = None) -> None:
    """Random safetensors for the tensors ``config`` describes (config.json itself is left alone)."""
    torch_dtype = parse_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: random_tensor(name, shape, generator).to(torch_dtype).contiguous()
        for name, shape in checkpoint_shapes(config).items()
    }
    _save_tensors(out, tensors, max_shard_bytes)


def _save_tensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    for stale in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if not max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@torch.no_grad()
def randomize_parameters_(model, seed: int = 0) -> None:
    """Fills a built model's parameters in place with the same distributions as write_random_model."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        param.copy_(random_tensor(name, tuple(param.shape), generator, device=param.device))
