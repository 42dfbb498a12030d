"""decode_linear_cuda on a GPU: the small-batch linear (plain, bias, SiLU-gated) against torch, and that it
is deterministic. The same kernel runs on CPU under Triton's interpreter in tests/triton_kernels_check.py;
these check the compiled kernel (bfloat16 included). tests/test_models.py checks the model's few-rows path."""

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, (32, 128, 4, 3), (16, 64, 4, 2), (64, 256, 8, 3)])
def test_decode_linear_matches_torch(dtype, config):
    from token_engine.layers import decode_linear_cuda as dl

    torch.manual_seed(0)
    k_dim, n_out = 1000, 300
    w = (torch.randn(2 * n_out, k_dim, device="cuda") / k_dim**0.5).to(dtype)
    b = torch.randn(2 * n_out, device="cuda").to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in (1, 7, 16, 20, 32):
        x = torch.randn(rows, k_dim, device="cuda").to(dtype)
        torch.testing.assert_close(dl.decode_linear(x, w, b, config=config), F.linear(x, w, b), atol=tol, rtol=tol)
        gate_up = F.linear(x, w, b)
        want = F.silu(gate_up[:, :n_out]) * gate_up[:, n_out:]
        torch.testing.assert_close(dl.decode_linear(x, w, b, gated=True, config=config), want, atol=tol, rtol=tol)


def test_decode_linear_is_deterministic():
    from token_engine.layers import decode_linear_cuda as dl

    torch.manual_seed(1)
    w = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 8192, device="cuda", dtype=torch.bfloat16)
    first = dl.decode_linear(x, w)
    for _ in range(10):
        assert torch.equal(dl.decode_linear(x, w), first)


def test_decode_linear_refuses_more_rows_than_it_pads_to():
    from token_engine.layers import decode_linear_cuda as dl

    w = torch.randn(32, 64, device="cuda")
    with pytest.raises(ValueError, match="at most 32 rows"):
        dl.decode_linear(torch.randn(33, 64, device="cuda"), w)


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("slices", [2, 4, 7])
def test_split_k_partials_through_the_norm_match_the_unsplit_layer(rows, slices):
    """decode_linear_split's partial sums, added up by the add + RMSNorm after the layer, give what the unsplit
    layer followed by the same norm gives (bfloat16: up to the rounding of a different summation order)."""
    from token_engine.layers import blocks_cuda
    from token_engine.layers import decode_linear_cuda as dl

    torch.manual_seed(rows * 10 + slices)
    k_dim, n_out = 3000, 520
    w = (torch.randn(n_out, k_dim, device="cuda") / k_dim**0.5).to(torch.bfloat16)
    x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, n_out, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(n_out, device="cuda", dtype=torch.bfloat16) + 0.5
    parts = dl.decode_linear_split(x, w, slices, (32, 128, 4, 3))
    assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, n_out) and 2 <= parts.shape[0] <= slices
    torch.testing.assert_close(parts.sum(0), F.linear(x.float(), w.float()), atol=1e-3, rtol=1e-3)
    got, got_res = blocks_cuda.rms_norm(parts, norm_w, 1e-6, r)
    want, want_res = blocks_cuda.rms_norm(F.linear(x, w), norm_w, 1e-6, r)
    torch.testing.assert_close(got_res, want_res, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_rms_norm_refuses_partials_without_a_residual():
    from token_engine.layers import blocks_cuda

    with pytest.raises(ValueError, match="needs the residual"):
        blocks_cuda.rms_norm(torch.randn(2, 3, 64, device="cuda"), torch.ones(64, device="cuda"), 1e-6)
