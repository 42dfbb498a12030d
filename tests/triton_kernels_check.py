"""Checks the CUDA path's Triton kernels on CPU tensors under Triton's interpreter.

Run by tests/test_attention.py in a subprocess with TRITON_INTERPRET=1 (the variable must be set before triton
is imported), only where triton is installed. Prints "ok <name>" per check; exits non-zero on a mismatch.
"""

import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

# Triton 3.6's interpreter turns a loaded scalar into a loop bound with int(array of one element), which
# numpy >= 2.3 refuses; take the element explicitly. Only the interpreter is affected, not compiled kernels.
_patch_tensor = interpreter._patch_lang_tensor


def _patched(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patched

from token_engine.layers import attention_cuda, blocks_cuda, decode_linear_cuda  # noqa: E402
from token_engine.layers.attention import (  # noqa: E402
    _paged_attention_reference,
    allocate_kv_pool,
    build_metadata,
    store_kv,
)
from token_engine.layers.blocks import RMSNorm, apply_rotary  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
rng = random.Random(0)
H, HKV, D = 8, 2, 16


def close(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item()
    if not err <= tol:
        print(f"FAIL {name}: max abs error {err} > {tol}")
        sys.exit(1)
    print(f"ok {name} ({err:.2e})")


def check_attention(block_size, dtype, tol):
    pool = allocate_kv_pool(48, 2, block_size, HKV, D, dtype)
    free = list(range(48))
    rng.shuffle(free)
    cached, new = [37, 0, 5, 20], [1, 9, 4, 1]
    lens = [c + n for c, n in zip(cached, new)]
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    for s, c in enumerate(cached):
        if c:
            meta = build_metadata([c], [c], [tables[s]], block_size)
            store_kv(torch.randn(c, HKV, D).to(dtype), torch.randn(c, HKV, D).to(dtype), pool, 1, meta)
    meta = build_metadata(new, lens, tables, block_size)
    total = sum(new)
    q, k, v = (torch.randn(total, n, D).to(dtype) for n in (H, HKV, HKV))
    expected_pool = pool.clone()
    store_kv(k, v, expected_pool, 1, meta)
    attention_cuda.store_kv(k, v, pool, 1, meta)
    assert torch.equal(pool, expected_pool), "store_kv wrote different slots"
    print(f"ok store_kv bs={block_size} {dtype}")
    ref = _paged_attention_reference(q, pool, 1, meta, 0.25, None)
    close(f"mixed prefill+decode bs={block_size} {dtype}", attention_cuda.paged_attention(q, pool, 1, meta, 0.25,
                                                                                          None, k, v), ref, tol)
    decode = build_metadata([1] * 4, lens, tables, block_size)
    qd = torch.randn(4, H, D).to(dtype)
    for window in (None, 6):
        ref = _paged_attention_reference(qd, pool, 1, decode, 0.25, window)
        got = attention_cuda.paged_attention(qd, pool, 1, decode, 0.25, window)
        close(f"decode bs={block_size} {dtype} window={window}", got, ref, tol)


def check_prefill(block_size, dtype, tol, config):
    """The paged prefill kernel alone on a ragged batch: fresh prompts, chunks over cached prefixes that start
    and end inside pool blocks, several query tiles per sequence, sliding windows, GQA groups of 4."""
    from token_engine.layers.attention_prefill_cuda import prefill_attention, prefill_tiles

    cached, new = [0, 21, 3, 40, 0], [37, 18, 2, 9, 5]
    lens = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    pool = torch.randn(num_blocks, 1, 2, block_size, HKV, D).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = build_metadata(new, lens, tables, block_size)
    q = torch.randn(sum(new), H, D).to(dtype)
    seqs, firsts = prefill_tiles([(s, n) for s, n in enumerate(new)], config[0])
    tile_seq, tile_m = torch.tensor(seqs, dtype=torch.int32), torch.tensor(firsts, dtype=torch.int32)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    for window in (None, 7):
        ref = _paged_attention_reference(q.float(), pool.float(), 0, meta, 0.3, window)
        for splits in (1, 3):  # 3: the context in slices, combined by the merge kernel (some slices empty)
            out = torch.full_like(q, float("nan"))  # every row must be written
            prefill_attention(q, k_cache, v_cache, meta, tile_seq, tile_m, 0.3, window, out, config=config,
                              num_splits=splits)
            close(f"paged prefill bs={block_size} {dtype} tiles={config[:2]} window={window} splits={splits}",
                  out, ref, tol)


def check_mixed_step_layout(dtype, tol):
    """Mixed steps padded into a CUDA graph's fixed layout (token_engine.core.mixed_graphs): attention over the
    static buffers equals the reference on the real rows, and a smaller step after a larger one leaves nothing
    of the larger one behind (its sequences become the dummy's)."""
    from token_engine.core.mixed_graphs import MixedStepLayout

    block_size = 4
    layout = MixedStepLayout(torch.device("cpu"), block_size, H, D, max_num_seqs=6, max_blocks_per_seq=16,
                             max_num_batched_tokens=100)
    wide = MixedStepLayout(torch.device("cpu"), block_size, H, D, max_num_seqs=40, max_blocks_per_seq=16,
                           max_num_batched_tokens=4096)
    assert wide.key_for([100] + [1] * 20, 4) == (128, 32)  # small steps: the next bucket up
    assert wide.key_for([1617], 4) is None  # 27% padding at 2048: eager
    assert wide.key_for([1900, 1], 4) == (2048, 8)  # within an eighth of the bucket
    assert wide.key_for([1] * 8, 4) is None  # decode-only steps have their own graphs
    assert wide.key_for([30] * 5, 4) is None  # more prefilling sequences than a graph's tiles allow
    assert wide.key_for([3000, 1], 17) is None  # wider block tables than captured
    print("ok mixed step buckets")
    pool = torch.randn(60, 1, 2, block_size, HKV, D).to(dtype)
    free = list(range(60))
    rng.shuffle(free)
    for cached, new in (([37, 0, 5, 20, 12], [1, 9, 4, 1, 30]), ([9, 3], [1, 6])):
        lens = [c + n for c, n in zip(cached, new)]
        tables = [free[: -(-n // block_size)] for n in lens]
        rng.shuffle(free)
        meta = build_metadata(new, lens, tables, block_size)
        key = layout.key_for(new, int(meta.block_tables.shape[1]))
        assert key is not None and key[0] > sum(new), key
        n = sum(new)
        rows = layout.fill(key[0], list(range(n)), list(range(n)), meta.slot_mapping, new, lens, meta.block_tables,
                           [n - 1, 0])
        assert rows.tolist() == [n - 1, 0], rows
        q = torch.randn(key[0], H, D).to(dtype)
        ref = _paged_attention_reference(q[:n].float(), pool.float(), 0, meta, 0.3, None)
        for splits in (None, 3):  # the layout's own choice, and the context in slices over the dummy tiles too
            static = layout.static_meta(key)
            if splits:
                static.backend_state["cuda_plan"]["splits"] = splits
            got = attention_cuda.paged_attention(q, pool, 0, static, 0.3)[:n]
            assert torch.isfinite(got).all(), "a real row of the padded step is not finite"
            close(f"mixed step in the graph layout {key} splits={splits} {dtype}", got, ref, tol)
        assert (layout.slot_mapping[n : key[0]] == -1).all(), "padded rows must not write K/V"


def check_negative_slots():
    pool = allocate_kv_pool(4, 1, 2, HKV, D, torch.float32)
    meta = build_metadata([2], [2], [[3]], 2)
    meta.slot_mapping = torch.tensor([6, -1])
    attention_cuda.store_kv(torch.ones(2, HKV, D), torch.ones(2, HKV, D), pool, 0, meta)
    assert pool[3, 0, :, 0].abs().sum() > 0 and pool[3, 0, :, 1].abs().sum() == 0 and pool[:3].abs().sum() == 0
    print("ok store_kv skips negative slots")


def check_layers(dtype, tol):
    hidden = 48
    norm = RMSNorm(hidden, 1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(5, hidden).to(dtype)
    r = torch.randn(5, hidden).to(dtype)
    close(f"rms_norm {dtype}", blocks_cuda.rms_norm(x, norm.weight, 1e-6), norm(x), tol)
    got, got_res = blocks_cuda.rms_norm(x, norm.weight, 1e-6, r)
    want, want_res = norm(x, r)
    close(f"add+rms_norm {dtype}", got, want, tol)
    close(f"add+rms_norm residual {dtype}", got_res, want_res, 0)

    qkv = torch.randn(5, (H + 2 * HKV) * D).to(dtype)
    q = qkv[:, : H * D].view(5, H, D)
    k = qkv[:, H * D : (H + HKV) * D].view(5, HKV, D)
    angles = torch.randn(5, D // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_out, k_out = blocks_cuda.qk_rotary(q, k, cos, sin)
    close(f"rotary q {dtype}", q_out, apply_rotary(q, cos, sin), tol)
    close(f"rotary k {dtype}", k_out, apply_rotary(k, cos, sin), tol)
    qn, kn = RMSNorm(D, 1e-6, dtype=dtype), RMSNorm(D, 1e-6, dtype=dtype)
    with torch.no_grad():
        qn.weight.normal_(1.0, 0.1)
        kn.weight.normal_(1.0, 0.1)
    q_out, k_out = blocks_cuda.qk_rotary(q, k, cos, sin, qn.weight, kn.weight, 1e-6)
    close(f"q norm + rotary {dtype}", q_out, apply_rotary(qn(q), cos, sin), tol)
    close(f"k norm + rotary {dtype}", k_out, apply_rotary(kn(k), cos, sin), tol)

    # rotary with the K/V store fused in: the pool gets exactly what store_kv would write
    v = qkv[:, (H + HKV) * D :].view(5, HKV, D)
    meta = build_metadata([2, 3], [2, 7], [[5, 1], [3, 0]], 4)
    meta.slot_mapping[1] = -1  # a padded row: not written
    pool = allocate_kv_pool(6, 2, 4, HKV, D, dtype)
    want_pool = pool.clone()
    q_out, k_out = blocks_cuda.qk_rotary(q, k, cos, sin, v=v, kv_pool=pool, layer=1, meta=meta)
    store_kv(k_out, v, want_pool, 1, meta)
    assert torch.equal(pool, want_pool), "fused rotary store differs from store_kv"
    assert pool[5, 1, :, 1].abs().sum() == 0
    print(f"ok rotary with fused K/V store {dtype}")

    gate_up = torch.randn(3, 2 * 40).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    close(f"silu_and_mul {dtype}", blocks_cuda.silu_and_mul(gate_up), want, tol)


def check_decode_linear(dtype, tol):
    """decode_linear (plain, bias, SiLU-gated gate_up) against the torch ops it replaces."""
    F = torch.nn.functional
    k_dim, n_out = 200, 40
    w = (torch.randn(2 * n_out, k_dim) / k_dim**0.5).to(dtype)
    b = torch.randn(2 * n_out).to(dtype)
    lin = decode_linear_cuda.decode_linear
    cfg = (16, 64, 4, 2)  # K=200 over BLOCK_K=64: the last step is short; N=40 over 16: so is the last tile
    for rows in (1, 5):
        x = torch.randn(rows, k_dim).to(dtype)
        close(f"decode_linear rows={rows} {dtype}", lin(x, w, config=cfg), F.linear(x, w), tol)
        close(f"decode_linear +bias rows={rows} {dtype}", lin(x, w, b, config=cfg), F.linear(x, w, b), tol)
        gate_up = F.linear(x, w, b)
        close(f"decode_linear gated rows={rows} {dtype}", lin(x, w, b, gated=True, config=cfg),
              F.silu(gate_up[:, :n_out]) * gate_up[:, n_out:], tol)
    x = torch.randn(20, k_dim).to(dtype)  # over 16 rows: the 32-row tile
    close(f"decode_linear rows=20 {dtype}", lin(x, w, b, config=cfg), F.linear(x, w, b), tol)
    # split K: 200 over 3 slices of whole 64-wide tiles is 128 + 72, so two slices come back, not three
    parts = decode_linear_cuda.decode_linear_split(x, w, 3, cfg)
    assert parts.shape == (2, 20, 2 * n_out) and parts.dtype == torch.float32, parts.shape
    close(f"decode_linear_split {dtype}", parts.sum(0), F.linear(x.float(), w.float()), tol)
    # the norm after o / down adds the slices up, rounds, adds the residual: as on the unsplit output
    norm_w, r = torch.randn(2 * n_out).to(dtype), torch.randn(20, 2 * n_out).to(dtype)
    got, got_res = blocks_cuda.rms_norm(parts, norm_w, 1e-6, r)
    want, want_res = blocks_cuda.rms_norm(parts.sum(0).to(dtype), norm_w, 1e-6, r)
    close(f"rms_norm of split-K partials {dtype}", got, want, tol)
    close(f"rms_norm of split-K partials, residual {dtype}", got_res, want_res, tol)


with torch.no_grad():
    check_decode_linear(torch.float32, 1e-4)
    check_decode_linear(torch.float16, 3e-2)
    check_negative_slots()
    check_mixed_step_layout(torch.float32, 1e-5)
    check_attention(4, torch.float32, 1e-5)
    check_prefill(4, torch.float32, 1e-5, (16, 8, 4, 1))  # key tiles span two pool blocks
    check_prefill(16, torch.float16, 2e-2, (16, 8, 4, 1))  # key tiles inside one pool block
    err = attention_cuda.verify_prefill(torch.float32, H, HKV, D, 16, "cpu", build_metadata,
                                       _paged_attention_reference)  # the engine's startup check
    close("startup prefill check", torch.tensor(err), torch.tensor(0.0), 1e-5)
    # the interpreter computes bfloat16 dots wrongly (raw bits); float16 exercises the same low-precision code
    check_attention(16, torch.float16, 2e-2)
    check_layers(torch.float32, 1e-5)
    check_layers(torch.float16, 2e-2)  # bfloat16 is checked on a GPU (tests marked gpu)
print("all kernels ok")
