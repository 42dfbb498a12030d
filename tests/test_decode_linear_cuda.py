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
    for rows in (1, 7, 16):
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
    with pytest.raises(ValueError, match="at most 16 rows"):
        dl.decode_linear(torch.randn(17, 64, device="cuda"), w)
