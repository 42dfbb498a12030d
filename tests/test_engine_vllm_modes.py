"""Engine servers started with vLLM's policy flags: --scheduling-policy fcfs and --logprobs-mode raw_logits."""

from __future__ import annotations

import pytest

from tests.engine_harness import ServerThread, engine_config, write_tiny_qwen3

PROMPT = [9707, 11, 1246, 525, 498, 30, 358, 1079, 264, 1273, 13]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def test_fcfs_policy_refuses_a_priority_like_vllm(model_dir):
    config = engine_config(model_dir, max_model_len=64, num_gpu_blocks_override=32)
    with ServerThread(config, scheduling_policy="fcfs") as srv, srv.client() as c:
        r = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "priority": 3, "sampling_params": {}})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "Got priority 3 but Priority scheduling is not enabled."
        r = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200


def test_raw_logits_mode_gives_the_logits_themselves(model_dir):
    """raw_logits and raw_logprobs differ by one constant per position (the log-partition), ranks equal."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 3}}
    outs = {}
    for mode in ("raw_logprobs", "raw_logits"):
        config = engine_config(model_dir, max_model_len=64, num_gpu_blocks_override=32, logprobs_mode=mode)
        with ServerThread(config) as srv, srv.client() as c:
            r = c.post("/inference/v1/generate", json=body)
            assert r.status_code == 200, r.text
            outs[mode] = r.json()["choices"][0]
            if mode == "raw_logits":
                refused = c.post("/inference/v1/generate", json={**body, "return_token_logprobs": True})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_logprobs"
    assert outs["raw_logits"]["token_ids"] == outs["raw_logprobs"]["token_ids"]
    for lp, logit in zip(outs["raw_logprobs"]["logprobs"]["content"], outs["raw_logits"]["logprobs"]["content"]):
        assert logit["rank"] == lp["rank"]
        assert [t["token_id"] for t in logit["top_logprobs"]] == [t["token_id"] for t in lp["top_logprobs"]]
        shifts = [a["logprob"] - b["logprob"] for a, b in zip(logit["top_logprobs"], lp["top_logprobs"])]
        assert max(shifts) - min(shifts) < 1e-3 and abs(shifts[0]) > 1e-3  # one shift, and not zero
        assert lp["logprob"] <= 0
