"""Building blocks of the Llama family: RMSNorm, rotary position embedding, SiLU-gated MLP.

Numerics follow Hugging Face's modules step by step (norm statistics in float32, rotary angles in
float32 then cast to the activation dtype) so that logits match `transformers` within dtype tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, first adds it (x + residual) and returns (normed, the sum)."""

    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and x.dim() == 2:
            from token_engine.layers import blocks_cuda

            return blocks_cuda.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Rotary embedding


@dataclass(frozen=True)
class RopeSpec:
    """What a config says about rotary embedding, in one normalized shape.

    `scaling` holds the raw scaling keys (factor, low_freq_factor, ...) for the non-default types.
    """

    theta: float
    rope_type: str = "default"
    scaling: tuple[tuple[str, float], ...] = ()
    partial_rotary_factor: float = 1.0

    def param(self, name: str, default=None):
        return dict(self.scaling).get(name, default)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_spec_from_config(config: dict) -> RopeSpec:
    """Reads both the old (`rope_theta` + `rope_scaling`) and the new (`rope_parameters`) config shapes."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**params, **scaling}
    theta = merged.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = merged.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if rope_type in ("llama3", "yarn"):
        if config.get("original_max_position_embeddings"):
            merged["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        merged.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    kept = tuple(sorted((k, v) for k, v in merged.items() if isinstance(v, (int, float, bool)) and v is not None))
    return RopeSpec(theta=float(theta), rope_type=rope_type, scaling=kept, partial_rotary_factor=float(partial))


def rope_inv_freq(spec: RopeSpec, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32) and the cos/sin scale ("attention factor")."""
    dim = int(head_dim * spec.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "default":
        return inv_freq, 1.0
    if spec.rope_type == "linear":
        return inv_freq / float(spec.param("factor")), 1.0
    if spec.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, spec), 1.0
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec, dim, max_position_embeddings)
    raise ValueError(f"unsupported rope type {spec.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    factor = float(spec.param("factor"))
    low = float(spec.param("low_freq_factor", 1.0))
    high = float(spec.param("high_freq_factor", 4.0))
    old_len = float(spec.param("original_max_position_embeddings"))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(spec: RopeSpec, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = spec.theta
    original = float(spec.param("original_max_position_embeddings") or max_position_embeddings)
    factor = spec.param("factor")
    factor = float(factor) if factor else max_position_embeddings / original
    attention_factor = spec.param("attention_factor")
    mscale, mscale_all_dim = spec.param("mscale"), spec.param("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = spec.param("beta_fast") or 32
    beta_slow = spec.param("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for the step's positions once per forward; layers apply them to q and k."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.spec = spec
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = rope_inv_freq(spec, head_dim, max_position_embeddings)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recomputes inv_freq after the module was materialized from the meta device."""
        inv_freq, _ = rope_inv_freq(self.spec, self.head_dim, self.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rotary_dim]. Rotate-half convention (HF / NeoX)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# MLP


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused in one matmul (rows: gate then up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, dtype=None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            from token_engine.layers import blocks_cuda

            return self.down_proj(blocks_cuda.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
