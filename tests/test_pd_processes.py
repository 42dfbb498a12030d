"""P/D with two engine processes over HTTP and NIXL: the prefill engine is a real `token_engine.cli serve`
subprocess, the decode engines are real HTTP servers in this process. A caller does the two
/inference/v1/generate hops itself, as vLLM's tokens-only guide does. The prefill process is killed and
restarted (same engine id and side-channel port) to check both failure policies and the peer re-add."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.engine_harness import EngineProcess, ServerThread, engine_config, free_port, write_tiny_qwen3

GREEDY = {"temperature": 0.0, "max_tokens": 8}
PROMPT = [1500 + 37 * i for i in range(29)]


def kv_config(engine_id: str, policy: str = "fail") -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_load_failure_policy": policy}


class PrefillProcess(EngineProcess):
    def __init__(self, model_dir, side_channel_port: int):
        super().__init__(model_dir, kv_config("prefill-proc"), side_channel_port)

    def prefill(self, prompt: list[int]) -> dict:
        r = self.client.post("/inference/v1/generate", json={
            "token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        assert r.status_code == 200, r.text
        return r.json()["kv_transfer_params"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("pdp") / "tiny")
    side_port = free_port()
    prefill = PrefillProcess(model_dir, side_port)
    with ServerThread(engine_config(model_dir, kv_transfer_config=kv_config("decode-fail"))) as d_fail, \
            ServerThread(engine_config(model_dir, kv_transfer_config=kv_config("decode-re", "recompute"))) as d_re:
        state = {"model": model_dir, "side_port": side_port, "prefill": prefill, "fail": d_fail, "re": d_re}
        yield state
        state["prefill"].kill()
    mp.undo()
    torch.set_num_threads(threads)


def generate(server: ServerThread, prompt: list[int], params: dict | None = None) -> httpx.Response:
    with server.client() as c:
        return c.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": GREEDY,
                                                      **({"kv_transfer_params": params} if params else {})})


def live_prefill(setup) -> PrefillProcess:
    """The module's prefill process, started anew where a test before killed it (the tests run in any order)."""
    if setup["prefill"].proc.poll() is not None:
        setup["prefill"].kill()
        setup["prefill"] = PrefillProcess(setup["model"], setup["side_port"])
    return setup["prefill"]


def metric(server: ServerThread, name: str) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def collocated(server: ServerThread, prompt: list[int]) -> list[int]:
    r = generate(server, prompt)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_pd_over_http_equals_collocated_and_reports_transfer_metrics(setup):
    expected = collocated(setup["fail"], PROMPT)
    params = live_prefill(setup).prefill(PROMPT)
    assert params["remote_port"] == setup["side_port"] and params["remote_num_tokens"] == len(PROMPT)
    transfers = metric(setup["fail"], "vllm:nixl_xfer_time_seconds_count")
    descriptors = metric(setup["fail"], "vllm:nixl_num_descriptors_sum")
    r = generate(setup["fail"], PROMPT, params)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected
    assert metric(setup["fail"], "vllm:nixl_xfer_time_seconds_count") == transfers + 1
    # 8 consecutive blocks -> one descriptor
    assert metric(setup["fail"], "vllm:nixl_num_descriptors_sum") == descriptors + 1


def test_prefill_killed_before_decode_reads_fails_or_recomputes(setup):
    expected = collocated(setup["re"], PROMPT[:21])
    params_fail = live_prefill(setup).prefill(PROMPT[:21])
    params_re = setup["prefill"].prefill(PROMPT[:21])
    setup["prefill"].kill()
    r = generate(setup["fail"], PROMPT[:21], params_fail)
    # the upstream engine failed, not this one: 502 with an OpenAI error body that says what and why
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["message"].startswith("KV handoff failed: side_channel") and error["code"] == 502
    r = generate(setup["re"], PROMPT[:21], params_re)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected


def test_restarted_prefill_engine_is_re_added(setup):
    setup["prefill"].kill()  # (a no-op where the test before killed it) the same side-channel port, anew
    setup["prefill"] = PrefillProcess(setup["model"], setup["side_port"])
    expected = collocated(setup["fail"], PROMPT[:13])
    for _ in range(2):
        params = setup["prefill"].prefill(PROMPT[:13])
        r = generate(setup["fail"], PROMPT[:13], params)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
