"""FlashAttention-3 as the prefill backend: where the library is found, and (on a Hopper GPU with the library)
that the engine's dispatch through it equals the plain path. Without a GPU or the library the GPU tests skip."""

import pytest
import torch

from tests.test_attention import _gpu_case
from token_engine.layers import attention_fa3
from token_engine.layers.attention import _paged_attention_reference, verify_fa3


def test_a_library_path_that_is_not_there_says_so():
    path, why = attention_fa3.locate({attention_fa3.ENV_LIBRARY: "/nowhere/_vllm_fa3_C.abi3.so"})
    assert path is None
    assert "/nowhere/_vllm_fa3_C.abi3.so: no such file" in why
    assert attention_fa3.load({attention_fa3.ENV_LIBRARY: "/nowhere/_vllm_fa3_C.abi3.so"}) == why


def test_the_backend_is_off_unless_the_variable_names_a_library():
    assert not attention_fa3.asked_for({}) and not attention_fa3.asked_for({attention_fa3.ENV_LIBRARY: "off"})
    assert attention_fa3.locate({}) == (None, f"{attention_fa3.ENV_LIBRARY} is not set")
    path, why = attention_fa3.locate({attention_fa3.ENV_LIBRARY: "off"})
    assert path is None and "off" in why


def test_vllm_asked_for_but_not_installed_says_so():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    path, why = attention_fa3.locate({attention_fa3.ENV_LIBRARY: "vllm"})
    assert path is None and "no vllm package is installed" in why


def test_an_installed_vllm_is_found_without_importing_it(tmp_path, monkeypatch):
    import sys

    package = tmp_path / "vllm"
    (package / "vllm_flash_attn").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    library = package / "vllm_flash_attn" / attention_fa3.LIBRARY_FILE
    library.write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert attention_fa3.asked_for({attention_fa3.ENV_LIBRARY: "vllm"})
    assert attention_fa3.locate({attention_fa3.ENV_LIBRARY: "vllm"}) == (str(library), "")
    assert "vllm" not in sys.modules


def test_a_file_that_is_no_library_gives_the_loaders_reason(tmp_path):
    junk = tmp_path / "_vllm_fa3_C.abi3.so"
    junk.write_bytes(b"not a shared object")
    assert attention_fa3.locate({attention_fa3.ENV_LIBRARY: str(junk)}) == (str(junk), "")
    why = attention_fa3.load_library(str(junk))
    assert why is not None and str(junk) in why


def test_decode_rows_get_no_fa3_queries():
    seqused, max_q = attention_fa3.step_args([150, 1, 0, 70], torch.device("cpu"))
    assert seqused is not None and seqused.tolist() == [150, 0, 0, 70] and max_q == 150
    assert attention_fa3.step_args([150, 0, 70], torch.device("cpu")) == (None, 150)


def _fa3_unavailable() -> str | None:
    return "needs a CUDA device" if not torch.cuda.is_available() else attention_fa3.load()


needs_fa3 = pytest.mark.skipif(_fa3_unavailable() is not None, reason=f"FA3: {_fa3_unavailable()}")


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("window", [None, 300])
def test_fa3_prefill_over_cached_prefixes_matches_the_reference(monkeypatch, window):
    """The paged prefill kernel's GPU case through FA3: chunks over cached prefixes, fresh prompts and decodes in
    one step, bf16, Qwen2.5-7B's head shape, a pool of two layers read at its second."""
    from token_engine.layers import attention_cuda

    monkeypatch.setattr(attention_cuda, "PREFILL_FA3", True)
    cached, new = [0, 2047, 16, 5000, 700, 0, 129], [1000, 300, 1, 1600, 2, 77, 1]
    pool, meta, q, k, v = _gpu_case(16, torch.bfloat16, 28, 4, 128, cached, new, seed=11)
    attention_cuda.store_kv(k, v, pool, 1, meta)
    ref = _paged_attention_reference(q.float(), pool.float(), 1, meta, 128**-0.5, window)
    out = attention_cuda.paged_attention(q, pool, 1, meta, 128**-0.5, window, k, v)
    assert meta.backend_state["cuda_plan"]["fa3"] is not None and meta.backend_state["cuda_plan"]["tiles"] is None
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa3_passes_the_start_up_check_and_refuses_32_bit_pools(dtype):
    from token_engine.layers import attention_cuda

    ok, why = verify_fa3(dtype, 28, 4, 128, 16, "cuda")
    assert ok, why
    assert not attention_cuda.PREFILL_FA3  # the check leaves the switch to its caller
    ok, why = verify_fa3(torch.float32, 28, 4, 128, 16, "cuda")
    assert not ok and "16-bit" in why


@pytest.mark.gpu
@needs_fa3
@pytest.mark.parametrize("sliding_window", [None, 40])
@pytest.mark.parametrize("graphs_fa3", [False, True], ids=["graphs-paged", "graphs-fa3"])
def test_mixed_step_graphs_with_fa3_for_eager_steps(tmp_path, monkeypatch, sliding_window, graphs_fa3):
    """With FA3 serving eager prefill, mixed steps are captured with the paged kernel or with FA3 itself (every
    length an upper bound fixed per bucket, the new-token counts in a buffer), pass the start-up check against
    the eager step (FA3), and replay what the eager step gives."""
    from token_engine.core.mixed_graphs import VERIFY_TOLERANCE, MixedGraphs
    from token_engine.layers import attention_cuda
    from token_engine.layers.attention import allocate_kv_pool, build_metadata
    from token_engine.models import load_model
    from token_engine.models.random_model import write_random_model

    overrides = {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                 "vocab_size": 1000}
    if sliding_window:
        overrides["sliding_window"] = sliding_window
    path = write_random_model(tmp_path, arch="mistral" if sliding_window else "qwen3", overrides=overrides, seed=3,
                              dtype="bfloat16")
    model = load_model(path, device="cuda")
    arch = model.arch
    pool = allocate_kv_pool(96, arch.num_layers, 16, arch.num_kv_heads, arch.head_dim, arch.dtype, "cuda")
    pool.normal_()
    monkeypatch.setattr(attention_cuda, "PREFILL_FA3", True)
    graphs = MixedGraphs(model, pool, 16, max_num_seqs=8, max_blocks_per_seq=12, max_num_batched_tokens=200,
                         fa3=graphs_fa3)
    graphs.capture()
    assert (graphs.layout.static_meta((64, 8)).backend_state["cuda_plan"]["fa3"] is not None) == graphs_fa3
    assert graphs.verify() <= VERIFY_TOLERANCE
    cached, new = [0, 30, 100, 7], [50, 1, 60, 1]
    lens = [c + n for c, n in zip(cached, new)]
    tables, at = [], 0
    for n in lens:
        tables.append(list(range(at, at + -(-n // 16))))
        at += len(tables[-1])
    ids = torch.randint(0, arch.vocab_size, (sum(new),)).tolist()
    positions = [p for c, n in zip(cached, new) for p in range(c, c + n)]
    cpu_meta = build_metadata(new, lens, tables, 16, "cpu")
    key = graphs.key_for(new, int(cpu_meta.block_tables.shape[1]))
    assert key is not None
    before = pool.clone()
    replayed = graphs.replay(key, ids, positions, cpu_meta, new)[0].float().clone()
    pool.copy_(before)
    eager_meta = build_metadata(new, lens, tables, 16, "cuda")
    with torch.no_grad():
        eager = model(torch.tensor(ids, device="cuda"), torch.tensor(positions, device="cuda"), eager_meta, pool)
    assert eager_meta.backend_state["cuda_plan"]["fa3"] is not None
    assert ((replayed - eager.float()).abs().max() / eager.float().abs().max()).item() <= VERIFY_TOLERANCE
