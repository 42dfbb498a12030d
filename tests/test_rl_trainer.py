"""A trainer process pushes new weights into a live engine over a gloo broadcast group: afterwards the engine's
greedy outputs and logprobs are those of a model built from the new weights, equal to a fresh engine started
from the updated checkpoint, and the weight_versions spans say which version sampled each token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.engine_harness import engine_config, greedy_reference, single_threaded_server, write_tiny_qwen3
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.models import load_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 23, 5, 99, 42, 7, 8, 2, 3, 17, 5]]
KEY = "trainer-key"


def generate(client, prompt, max_tokens=12, **extra):
    r = client.post("/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                                                 "logprobs": 0, **extra}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@torch.inference_mode()
def reference_logprobs(model, prompt, tokens):
    """log_softmax of a plain full forward over prompt + tokens, at each output position."""
    from token_engine.layers.attention import allocate_kv_pool, build_metadata

    seq = prompt + tokens
    n, bs = len(seq), 16
    blocks = -(-n // bs)
    arch = model.arch
    pool = allocate_kv_pool(blocks, arch.num_layers, bs, arch.num_kv_heads, arch.head_dim, arch.dtype)
    meta = build_metadata([n], [n], [list(range(blocks))], bs)
    hidden = model.forward(torch.tensor(seq), torch.arange(n), meta, pool)
    logp = model.compute_logits(hidden).float().log_softmax(-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_trainer_process_pushes_weights_over_gloo(tmp_path):
    model_dir = write_tiny_qwen3(tmp_path / "model")
    updated_dir = tmp_path / "updated"
    with single_threaded_server(engine_config(model_dir), rl_control=True,
                                api_keys=_keys()) as srv, srv.client(headers=_auth()) as c:
        before = [generate(c, p) for p in PROMPTS]
        baseline = c.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "tests.rl_trainer_process", srv.url, str(model_dir),
                               str(updated_dir), "step-1", KEY], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert c.get("/weight_info").json() == {"weight_version": "step-1"}
        compared = c.post("/weight_checker", json={"action": "compare", "baseline": baseline}).json()
        assert compared["match"] is False and len(compared["mismatches"]) == len(baseline)
        after = [generate(c, p) for p in PROMPTS]

    reference = load_model(updated_dir, dtype="float32")
    fresh = LLMEngine(engine_config(updated_dir))
    fresh_out = fresh.generate(PROMPTS, SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True))
    fresh.shutdown()
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(after, before)), "the update changed nothing"
    for prompt, choice, fresh_tokens in zip(PROMPTS, after, fresh_out):
        assert choice["token_ids"] == greedy_reference(reference, prompt, 12) == fresh_tokens
        want = reference_logprobs(reference, prompt, choice["token_ids"])
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert got == pytest.approx(want, abs=1e-4)
        assert choice["weight_versions"] == [{"version": "step-1", "start": 0, "end": 12}]
    assert before[0]["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]


def _keys():
    from splitserve_common.auth import ApiKeys

    return ApiKeys([KEY])


def _auth():
    return {"Authorization": f"Bearer {KEY}"}
