"""The Llama family (Llama, Qwen2, Qwen3, Mistral) as one module; the variants are ModelArch switches.

Parameter names follow Hugging Face checkpoints (model.layers.N.self_attn..., lm_head) except that q/k/v and
gate/up are fused into one matmul each; `load_weights` maps checkpoint names onto the fused rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from token_engine.layers.attention import AttentionMetadata, paged_attention, store_kv
from token_engine.layers.blocks import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from token_engine.models.arch import ModelArch

FEW_ROWS = 32  # steps of at most this many tokens use decode_linear_cuda (its MAX_ROWS) on CUDA


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.sliding_window = arch.sliding_window
        dt = arch.dtype
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias, dtype=dt)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias, dtype=dt)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dt)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dt)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_pool: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, meta, kv_pool))

    def attend(self, qkv, cos, sin, meta: AttentionMetadata, kv_pool: torch.Tensor) -> torch.Tensor:
        """The step's fused q/k/v projection [T, q+2kv] -> attention output [T, q] (before o_proj)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda and cos.shape[-1] == self.head_dim:
            from token_engine.layers import blocks_cuda

            norm = self.q_norm is not None
            q, k = blocks_cuda.qk_rotary(q, k, cos, sin, self.q_norm.weight if norm else None,
                                         self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                                         v=v, kv_pool=kv_pool, layer=self.layer_index, meta=meta)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            store_kv(k, v, kv_pool, self.layer_index, meta)
        out = paged_attention(q, kv_pool, self.layer_index, meta, self.scale, self.sliding_window, k=k, v=v)
        return out.reshape(-1, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_index: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_index)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias, dtype=arch.dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=arch.dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=arch.dtype)

    def forward(self, x, residual, cos, sin, meta, kv_pool):
        """Returns (mlp output, residual stream); the next norm adds them (fused on CUDA)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_pool)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_few_rows(self, x, residual, cos, sin, meta, kv_pool):
        """forward for a step of a few rows on CUDA: the linears go through decode_linear_cuda (its own kernel or
        cuBLAS, per shape, with the SiLU gate folded into gate_up), everything else as in forward. o and down
        may return split-K partial sums (_linear_into_norm), which the norm after each adds up: so may x."""
        from token_engine.layers.blocks_cuda import rms_norm
        from token_engine.layers.decode_linear_cuda import decode_linear

        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps, residual)
        h = attn.attend(decode_linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias), cos, sin, meta, kv_pool)
        h = _linear_into_norm(h, attn.o_proj)
        h, residual = rms_norm(h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps, residual)
        act = decode_linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True)
        return _linear_into_norm(act, mlp.down_proj), residual


def _linear_into_norm(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A few-rows linear whose output feeds only an add + RMSNorm: float32 partial sums over K slices where a
    split is tuned for its shape (more programs stream the weight; the norm's kernel does the sum)."""
    from token_engine.layers import decode_linear_cuda as dl

    split = dl.split_config(*linear.weight.shape, x.shape[0]) if linear.bias is None else None
    if split is None:
        return dl.decode_linear(x, linear.weight, linear.bias)
    return dl.decode_linear_split(x, linear.weight, split[1], split[0])


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=arch.dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=arch.dtype)
        self.rotary_emb = RotaryEmbedding(arch.rope, arch.head_dim, arch.max_position_embeddings)
        # decode-sized steps on CUDA take DecoderLayer.forward_few_rows (benchmarks switch it off to compare)
        self.few_rows_kernels = True

    def forward(self, input_ids, positions, meta, kv_pool):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        few_rows = self.few_rows_kernels and x.is_cuda and x.shape[0] <= FEW_ROWS
        residual = None
        for layer in self.layers:
            step = layer.forward_few_rows if few_rows else layer.forward
            x, residual = step(x, residual, cos, sin, meta, kv_pool)
        if few_rows:  # x may be split-K partial sums (forward_few_rows)
            from token_engine.layers.blocks_cuda import rms_norm

            return rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]
        return self.norm(x, residual)[0]


# checkpoint suffix -> (fused parameter suffix, shard index); shards are stacked in this order along dim 0
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, kv_pool) -> hidden [T, hidden]; compute_logits -> float32."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=arch.dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_pool: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_pool)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.model.few_rows_kernels and hidden.is_cuda and hidden.shape[0] <= FEW_ROWS:
            from token_engine.layers.decode_linear_cuda import decode_linear

            return decode_linear(hidden, weight).float()
        return torch.nn.functional.linear(hidden, weight).float()

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_buffers()

    def _fused_shard_slice(self, fused: str, shard: int) -> tuple[int, int]:
        arch = self.arch
        if fused == "qkv_proj":
            q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        inter = arch.intermediate_size
        return [(0, inter), (inter, 2 * inter)][shard]

    def expected_checkpoint_names(self) -> set[str]:
        """Checkpoint tensor names this model needs (before fusion)."""
        names = set()
        reverse = {}
        for part, (fused, _) in _FUSED_SHARDS.items():
            reverse.setdefault(fused, []).append(part)
        for name, _ in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, last = module_path.rpartition(".")
            if last in reverse:
                names.update(f"{parent}.{part}.{leaf}" for part in reverse[last])
            else:
                names.add(name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into parameters by name; returns the checkpoint names it used."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            module_path, _, leaf = name.rpartition(".")
            parent, _, last = module_path.rpartition(".")
            if last in _FUSED_SHARDS:
                fused, shard = _FUSED_SHARDS[last]
                target = params.get(f"{parent}.{fused}.{leaf}")
                if target is None:
                    continue
                start, end = self._fused_shard_slice(fused, shard)
                _copy_checked(target[start:end], tensor, name)
            else:
                target = params.get(name)
                if target is None:
                    continue
                _copy_checked(target, tensor, name)
            loaded.add(name)
        return loaded


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
    target.copy_(tensor)
