"""The logprob controls under vLLM's SamplingParams names, checked against a plain forward pass of the model:
teacher forcing, logprobs of chosen ids (output and prompt), and raw logprobs whatever the sampling filters."""

from __future__ import annotations

import pytest
import torch

from tests.engine_harness import engine_config, single_threaded_server, write_tiny_qwen3
from token_engine.layers.attention import allocate_kv_pool, build_metadata
from token_engine.models import load_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("lp") / "model")
    with single_threaded_server(engine_config(model_dir)) as srv, srv.client() as c:
        yield c, load_model(model_dir, dtype="float32")


@torch.inference_mode()
def log_softmax_rows(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row r is the model's log-softmax after tokens[:r + 1] (a full, cache-free forward)."""
    n, bs = len(tokens), 16
    blocks = -(-n // bs)
    arch = model.arch
    pool = allocate_kv_pool(blocks, arch.num_layers, bs, arch.num_kv_heads, arch.head_dim, arch.dtype)
    meta = build_metadata([n], [n], [list(range(blocks))], bs)
    hidden = model.forward(torch.tensor(tokens), torch.arange(n), meta, pool)
    return model.compute_logits(hidden).float().log_softmax(-1)


def rank_of(row: torch.Tensor, token: int) -> int:
    return int((row > row[token]).sum()) + 1


def gen(c, **sp):
    return c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sp})


def test_trace_decode_forces_the_tokens_and_returns_their_real_logprobs(setup):
    c, model = setup
    trace = [7, 7, 100, 3, 250, 1]
    r = gen(c, temperature=1.0, top_k=3, max_tokens=50, logprobs=1, trace_decode_token_ids=trace)
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == trace and choice["finish_reason"] == "length"
    rows = log_softmax_rows(model, PROMPT + trace)
    for i, (token, entry) in enumerate(zip(trace, choice["logprobs"]["content"])):
        row = rows[len(PROMPT) - 1 + i]
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry["rank"] == rank_of(row, token)
    assert gen(c, max_tokens=2, trace_decode_token_ids=trace).json()["choices"][0]["token_ids"] == trace[:2]


def test_logprob_token_ids_score_exactly_the_given_ids_at_each_step(setup):
    c, model = setup
    ids = [5, 17, 3]
    choice = gen(c, temperature=0, max_tokens=4, ignore_eos=True, logprob_token_ids=ids).json()["choices"][0]
    rows = log_softmax_rows(model, PROMPT + choice["token_ids"])
    for i, entry in enumerate(choice["logprobs"]["content"]):
        row = rows[len(PROMPT) - 1 + i]
        assert [t["token_id"] for t in entry["top_logprobs"]] == ids
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([float(row[t]) for t in ids], abs=1e-4)
        assert [t["rank"] for t in entry["top_logprobs"]] == [rank_of(row, t) for t in ids]
    bad = gen(c, max_tokens=2, logprobs=2, logprob_token_ids=ids)
    assert bad.status_code == 400 and "logprob_token_ids" in bad.json()["error"]["message"]
    assert gen(c, max_tokens=2, logprob_token_ids=[10 ** 6]).status_code == 400


def test_prompt_logprob_token_ids_from_a_start_row(setup):
    c, model = setup
    start, chosen = 3, [[1, 2], [40], [7, -1, 9]]
    r = gen(c, max_tokens=1, prompt_logprob_start=start, prompt_logprob_token_ids=chosen)
    assert r.status_code == 200, r.text
    prompt_lps = r.json()["prompt_logprobs"]
    rows = log_softmax_rows(model, PROMPT)
    assert prompt_lps[:start + 1] == [None] * (start + 1)
    for i, ids in enumerate(chosen):
        row, entry = rows[start + i], prompt_lps[start + i + 1]
        for t in (t for t in ids if t >= 0):
            assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=1e-4)
            assert entry[str(t)]["rank"] == rank_of(row, t)
        actual = PROMPT[start + i + 1]  # the prompt's own token is always there, as with prompt_logprobs
        assert entry[str(actual)]["logprob"] == pytest.approx(float(row[actual]), abs=1e-4)
    too_many = gen(c, max_tokens=1, prompt_logprob_start=8, prompt_logprob_token_ids=chosen)
    assert too_many.status_code == 400 and "rows" in too_many.json()["error"]["message"]
    assert gen(c, max_tokens=1, prompt_logprob_start=len(PROMPT), prompt_logprobs=0).status_code == 400


def test_sampled_token_logprobs_are_raw_whatever_the_filters(setup):
    c, model = setup
    choice = gen(c, temperature=0.7, top_k=2, top_p=0.5, seed=3, max_tokens=5, ignore_eos=True,
                 logprobs=0).json()["choices"][0]
    rows = log_softmax_rows(model, PROMPT + choice["token_ids"])
    for i, (token, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"])):
        assert entry["top_logprobs"] == []
        assert entry["logprob"] == pytest.approx(float(rows[len(PROMPT) - 1 + i][token]), abs=1e-4)
        assert entry["logprob"] < 0  # top_k=2/top_p=0.5 left one candidate: processed would have said 0.0
