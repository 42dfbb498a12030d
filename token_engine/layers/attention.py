"""Paged attention over the engine's single KV pool.

KV pool layout (one tensor per engine, block-major so one block across all layers is one contiguous region):

    kv_pool = torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype, device)

Layer i's K cache is the strided view `kv_pool[:, i, 0]` ([num_blocks, block_size, heads, dim]), V is
`kv_pool[:, i, 1]`. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Block 0 is an ordinary block: there is no
reserved null block. Padding entries of `block_tables` (beyond a sequence's used blocks) are never read, so
any value works there; a negative `slot_mapping` entry means "do not write" (padded tokens of a CUDA graph).

Per step the model's attention layer calls `store_kv` (the step's new K/V into the pool) and then
`paged_attention` (each sequence's new queries attend causally to its whole context: cached + new). The new
tokens of a sequence are assumed to be its last `query_len` positions, i.e. positions
`seq_len - query_len .. seq_len - 1`.

Backends: on CPU, gather each sequence's context by block table and call scaled_dot_product_attention (simple
and correct). On CUDA, `token_engine.layers.attention_cuda` (imported lazily) runs the same contract faster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F


@dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence attends to.

    slot_mapping:    [T] int64, pool slot (block_id * block_size + offset) of each new token; < 0 skips it.
    query_start_loc: [S+1] int32, cumulative new-token counts per sequence (tokens are grouped by sequence).
    seq_lens:        [S] int32, context length after this step (cached + new).
    block_tables:    [S, max_blocks] int32, padded block ids per sequence.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, filled lazily; the CPU backend loops over sequences and must not sync per layer.
    _host: tuple[list[int], list[int]] | None = field(default=None, repr=False, compare=False)
    # Backend-private cache (e.g. a flex_attention block mask built once per step, reused by every layer).
    backend_state: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def host_lists(self) -> tuple[list[int], list[int]]:
        """(query_start_loc, seq_lens) as Python lists, computed once per step."""
        if self._host is None:
            self._host = (self.query_start_loc.tolist(), self.seq_lens.tolist())
        return self._host


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds the metadata of one step from plain lists (what a model runner knows per sequence).

    The new tokens of sequence s are its positions `seq_lens[s] - query_lens[s] .. seq_lens[s] - 1`.
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    starts = [0]
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        if q_len > s_len:
            raise ValueError(f"query_len {q_len} exceeds seq_len {s_len}")
        if len(table) * block_size < s_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
        pos = s_len - q_len
        while pos < s_len:  # a block's run of slots at a time (a prefill chunk is hundreds of tokens)
            end = min(s_len, (pos // block_size + 1) * block_size)
            first = table[pos // block_size] * block_size - pos // block_size * block_size
            slots.extend(range(first + pos, first + end))
            pos = end
        starts.append(starts[-1] + q_len)
    width = max((len(t) for t in block_tables), default=0) or 1
    # Filled row by row through numpy: a long prompt's table is thousands of blocks, and a nested list of every
    # row padded to its width cost milliseconds a step to turn into a tensor.
    padded = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, table in zip(padded, block_tables):
        row[: len(table)] = table
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(padded).to(device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    meta._host = (starts, list(seq_lens))  # known here: spares the backend a device-to-host sync
    return meta


def allocate_kv_pool(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    return torch.zeros(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> None:
    """Writes the step's new K/V ([T, kv_heads, head_dim]) into layer `layer` of the pool at meta.slot_mapping."""
    if k.device.type == "cuda":
        from token_engine.layers import attention_cuda

        attention_cuda.store_kv(k, v, kv_pool, layer, meta)
        return
    num_blocks, _, _, block_size, heads, dim = kv_pool.shape
    slots = meta.slot_mapping
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    kv_pool[block_ids, layer, 0, offsets] = k.to(kv_pool.dtype)
    kv_pool[block_ids, layer, 1, offsets] = v.to(kv_pool.dtype)


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> out [T, heads, head_dim].

    Each sequence's new queries attend causally to its full context read from the pool (the layer stores the
    step's K/V first). `sliding_window` (Mistral): a query at position p sees keys at positions > p - window.
    `k`/`v` (optional, the step's new K/V as stored): a backend may use them directly for fresh prompts.
    """
    if q.device.type == "cuda":
        from token_engine.layers import attention_cuda

        # A prefill kernel that failed its startup check leaves prefill steps to the plain path.
        if meta.max_query_len == 1 or attention_cuda.PREFILL_KERNEL_OK:
            return attention_cuda.paged_attention(q, kv_pool, layer, meta, scale, sliding_window, k, v)
    return _paged_attention_reference(q, kv_pool, layer, meta, scale, sliding_window)


def _paged_attention_reference(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    starts, seq_lens = meta.host_lists()
    block_size = meta.block_size
    k_cache = kv_pool[:, layer, 0]
    v_cache = kv_pool[:, layer, 1]
    out = torch.empty_like(q)
    for s, ctx_len in enumerate(seq_lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-ctx_len // block_size)
        blocks = meta.block_tables[s, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [ctx, kv_heads, dim]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1).unsqueeze(0),  # [1, heads, q_len, dim]
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = o.squeeze(0).transpose(0, 1)
    return out


# FA3 loads paged K/V with TMA only where a pool block holds whole key tiles of its causal kernel (its tile width
# for that head dim); otherwise it gathers rows with cp.async. Head dims measured here only.
FA3_TMA_BLOCK = {128: 128}


def verify_fa3(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               device) -> tuple[bool, str]:
    """CUDA only. Loads FlashAttention-3 (token_engine.layers.attention_fa3) and runs the start-up check's ragged
    step through it, without and with a sliding window, against the plain path. (True, what passed) when every
    error is within the prefill tolerance, else (False, why not); leaves PREFILL_FA3 off either way."""
    from token_engine.layers import attention_cuda, attention_fa3

    why = attention_fa3.load()
    if why is not None:
        return False, why
    if dtype not in attention_fa3.DTYPES:
        return False, f"FA3 takes 16-bit inputs, the KV pool is {dtype}"
    tolerance = attention_cuda.PREFILL_CHECK_TOLERANCE.get(dtype, 3e-2)
    errors = []
    attention_cuda.PREFILL_FA3 = True
    try:
        for window in (None, 2 * block_size + 3):
            errors.append(attention_cuda.verify_prefill(dtype, num_heads, num_kv_heads, head_dim, block_size, device,
                                                        build_metadata, _paged_attention_reference, window))
    except Exception as exc:  # noqa: BLE001 - the library loaded but does not take this shape or device
        return False, f"FA3 failed on the check step: {type(exc).__name__}: {exc}"
    finally:
        attention_cuda.PREFILL_FA3 = False
    if not max(errors) <= tolerance:
        return False, f"FA3 differs from the reference by {max(errors):.3g} (tolerance {tolerance:g})"
    return True, f"within {max(errors):.2g} of the reference on the check step"


def warm_up_cuda(kv_pool: torch.Tensor, num_heads: int, max_num_seqs: int, block_size: int) -> int:
    """CUDA only. Checks the paged prefill kernel against the plain path on a small ragged step, turns FA3 prefill
    on where it is installed and passes the same check (verify_fa3), then compiles
    the decode kernels a mixed prefill + decode step uses, for every merge width a step
    of up to max_num_seqs sequences can need, so no request waits on a compile. Reads the pool, writes nothing
    to it. Returns how many variants it ran."""
    from token_engine.layers import attention_cuda, attention_fa3

    num_kv_heads, head_dim = kv_pool.shape[4], kv_pool.shape[5]
    try:
        err = attention_cuda.verify_prefill(kv_pool.dtype, num_heads, num_kv_heads, head_dim, block_size,
                                            kv_pool.device, build_metadata, _paged_attention_reference)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or launch here (shared memory, ...)
        logging.getLogger(__name__).warning("the paged prefill kernel does not run on this device (%s)", exc)
        err = float("inf")
    attention_cuda.PREFILL_KERNEL_OK = err <= attention_cuda.PREFILL_CHECK_TOLERANCE.get(kv_pool.dtype, 3e-2)
    if not attention_cuda.PREFILL_KERNEL_OK:
        logging.getLogger(__name__).warning("the paged prefill kernel differs from the reference by %.3g on this "
                                            "device: prefill falls back to the plain path", err)
    use_fa3, why = verify_fa3(kv_pool.dtype, num_heads, num_kv_heads, head_dim, block_size, kv_pool.device)
    attention_cuda.PREFILL_FA3 = use_fa3
    # asked for and not on (no such file, a load error, a mismatch) is worth a warning; not asked for is the default
    level = logging.INFO if use_fa3 else logging.WARNING if attention_fa3.asked_for() else logging.DEBUG
    logging.getLogger(__name__).log(level, "FA3 prefill %s: %s", "on" if use_fa3 else "off", why)
    if use_fa3 and block_size % FA3_TMA_BLOCK.get(head_dim, 1):
        logging.getLogger(__name__).info(
            "FA3 reads blocks of %d tokens as gathered rows; with --block-size a multiple of %d it loads them "
            "with TMA, which makes long prefills faster (docs/token-engine.md). Routers that hash KV blocks must "
            "use the same block size.", block_size, FA3_TMA_BLOCK[head_dim])
    seen = set()
    for num in range(1, max_num_seqs + 1):
        pad = attention_cuda.splits_pad(attention_cuda.decode_splits(num, num_kv_heads))
        if pad in seen:
            continue
        seen.add(pad)
        meta = build_metadata([1] * num, [1] * num, [[0]] * num, block_size, kv_pool.device)
        q = torch.zeros(num, num_heads, head_dim, dtype=kv_pool.dtype, device=kv_pool.device)
        ids = torch.arange(num, dtype=torch.int32, device=kv_pool.device)
        attention_cuda.decode_attention(q, kv_pool, 0, meta, 1.0, seq_ids=ids)
    return len(seen)
