"""FlashAttention-3 (Hopper) as an optional prefill backend over the paged KV pool.

FA3 is not a dependency: it is the compiled extension that vLLM wheels ship (`vllm/vllm_flash_attn/
_vllm_fa3_C.abi3.so`, built against torch's stable C ABI, so one build loads under several torch versions).
Where it comes from, TOKEN_ENGINE_FA3_LIBRARY:

- unset, empty or `off`: the backend is off (the default: it is another project's binary, built for another
  torch, loaded into the engine's process; docs/token-engine.md has what it gains);
- a path to that file;
- `vllm`: an installed `vllm` package's copy, located with importlib.util.find_spec("vllm"), which finds the
  package's folder without importing it (vllm's __init__ pulls in everything).

`load()` loads the file once with torch.ops.load_library and says why it cannot be used (no CUDA device, not a
Hopper card, no file, a load error); the op is then `torch.ops._vllm_fa3_C.fwd`. `prefill()` is one call of it
for every prefill chunk of a step, reading K/V from the pool in place: the layer's K cache `kv_pool[:, layer, 0]`
is already FA3's paged layout [pages, page_size, kv_heads, head_dim] (its page stride is not the tensor's
contiguous one, which FA3 takes), the step's block tables are FA3's page table, causal masking is bottom-right
aligned (new tokens are the last of each sequence's context) and a sliding window of w keys is FA3's left
window w - 1. Sequences of the step with one new token (decode rows) are given FA3 zero queries through
`seqused_q`; the decode kernel serves them.

The engine turns the backend on only after it matched the reference on a ragged step at start-up
(token_engine.layers.attention.warm_up_cuda); graph-captured steps keep the Triton kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Mapping

import torch

ENV_LIBRARY = "TOKEN_ENGINE_FA3_LIBRARY"
LIBRARY_FILE = "_vllm_fa3_C.abi3.so"
OFF = ("", "off", "0", "false", "no")
FROM_VLLM = "vllm"
DTYPES = (torch.bfloat16, torch.float16)


def asked_for(env: Mapping[str, str] | None = None) -> bool:
    """Whether TOKEN_ENGINE_FA3_LIBRARY asks for the backend (a path or `vllm`)."""
    env = os.environ if env is None else env
    return env.get(ENV_LIBRARY, "").strip().lower() not in OFF


def locate(env: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(path of the FA3 library, "") or (None, why there is none). Imports nothing."""
    env = os.environ if env is None else env
    value = env.get(ENV_LIBRARY, "").strip()
    if value.lower() in OFF:
        return None, f"{ENV_LIBRARY} is {'set to ' + value if value else 'not set'}"
    if value != FROM_VLLM:
        if os.path.isfile(value):
            return value, ""
        return None, f"{ENV_LIBRARY}={value}: no such file"
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, f"{ENV_LIBRARY}={FROM_VLLM} but no vllm package is installed"
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "vllm_flash_attn", LIBRARY_FILE)
        if os.path.isfile(path):
            return path, ""
    return None, f"the installed vllm package has no vllm_flash_attn/{LIBRARY_FILE}"


@functools.cache
def load_library(path: str) -> str | None:
    """torch.ops.load_library(path), once per path (a second load would register its ops again); None when
    `torch.ops._vllm_fa3_C.fwd` is then there, else why not."""
    try:
        torch.ops.load_library(path)
        torch.ops._vllm_fa3_C.fwd  # noqa: B018 - raises if the file registered no such op
    except Exception as exc:  # noqa: BLE001 - a missing symbol, another torch ABI, a foreign file: all say why
        return f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def load(env: Mapping[str, str] | None = None) -> str | None:
    """Loads the FA3 library for this process's CUDA device; None when its op is ready, else why not."""
    path, why = locate(env)
    if path is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"FA3 runs on Hopper (compute capability 9.x), this device is {major}.{minor}"
    return load_library(path)


def step_args(query_lens: list[int], device: torch.device) -> tuple[torch.Tensor | None, int]:
    """(seqused_q, max_seqlen_q) for a step whose sequences have these new-token counts: sequences with one new
    token get no FA3 queries (None when there is none such, so FA3 reads the lengths from cu_seqlens_q)."""
    prefill = [q if q > 1 else 0 for q in query_lens]
    max_q = max(prefill, default=0)
    if all(q != 1 for q in query_lens):
        return None, max_q
    return torch.tensor(prefill, dtype=torch.int32, device=device), max_q


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_q: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int = 0,
) -> torch.Tensor:
    """Causal attention of the step's new queries over their sequences' pooled context; writes out's rows of
    the sequences FA3 is given queries for. q/out [T, heads, head_dim]; k_cache/v_cache [pages, page_size,
    kv_heads, head_dim] (any page stride, contiguous rows); cu_seqlens_q [S + 1] and seq_lens [S] int32;
    block_tables [S, width] int32. num_splits 0: FA3 picks its context split."""
    window_left = sliding_window - 1 if sliding_window else -1
    torch.ops._vllm_fa3_C.fwd(
        q, k_cache, v_cache,
        None, None, None,  # k_new, v_new, q_v
        out,
        cu_seqlens_q, None, None,  # cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new
        seqused_q, seq_lens,
        max_seqlen_q, max_seqlen_k,
        block_tables,
        None, None,  # kv_batch_idx, leftpad_k
        None, None, None,  # rotary_cos, rotary_sin, seqlens_rotary
        None, None, None,  # q_descale, k_descale, v_descale
        scale, True, window_left, 0,  # softmax_scale, is_causal, window_size_left, window_size_right
        0.0, True,  # softcap, is_rotary_interleaved
        None, num_splits, None, 0,  # scheduler_metadata, num_splits, pack_gqa, sm_margin
        None, 1, 0, None,  # s_aux, cp_world_size, cp_rank, cp_tot_seqused_k
    )
    return out
