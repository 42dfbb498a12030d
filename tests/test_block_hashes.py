"""vLLM's prefix-cache block hashes: ours equal vLLM's own hasher for the same ids (algorithms, seeds, cache salt,
LoRA), and render hands them out for the ids it rendered when a request asks."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench import peers
from splitserve_common.block_hashes import BlockHashConfig, block_hashes, external_hash
from tests.render_harness import RenderServer, qwen3_config

IDS = list(range(1000, 1000 + 70))  # four full blocks of 16 and a partial one
CASES = [
    {"algo": "sha256", "block_size": 16, "ids": IDS},
    {"algo": "sha256_cbor", "block_size": 16, "ids": IDS},
    {"algo": "sha256", "block_size": 4, "ids": IDS[:9], "salt": "tenant-a"},
    {"algo": "sha256_cbor", "block_size": 8, "ids": IDS, "salt": "tenant-b", "lora": ["adapter", "/loras/adapter"]},
    {"algo": "sha256", "block_size": 16, "ids": IDS, "seed": "12345"},
]


def ours(case: dict) -> list[str]:
    config = BlockHashConfig(case["block_size"], case["algo"], seed=case.get("seed"))
    lora = tuple(case["lora"]) if case.get("lora") else None
    return [h.hex() for h in block_hashes(case["ids"], config, cache_salt=case.get("salt"), lora=lora)]


def test_only_full_blocks_are_hashed_and_each_chains_on_the_one_before():
    config = BlockHashConfig(16)
    full = block_hashes(IDS, config)
    assert len(full) == 4
    assert block_hashes(IDS[:64], config) == full  # the partial block adds nothing
    assert block_hashes(IDS[:32], config) == full[:2]  # a prefix's hashes are the prefix of the hashes
    changed = IDS[:20] + [7] + IDS[21:]
    assert block_hashes(changed, config)[:1] == full[:1] and block_hashes(changed, config)[1] != full[1]
    assert block_hashes(IDS, config, cache_salt="x")[0] != full[0]


def test_external_hash_is_the_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"hash_algo": "xxhash"}, {"hash_algo": "md5"}])
def test_bad_configurations_are_refused(bad):
    with pytest.raises(ValueError):
        BlockHashConfig(**bad)


# vLLM's own hasher over a real vllm.v1.request.Request, in the peer's venv.
VLLM_HASHER = r"""
import json, os, sys
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
case = json.loads(sys.stdin.read())
fn = get_hash_fn_by_name(case["algo"])
ku.init_none_hash(fn)
lora = LoRARequest(case["lora"][0], 1, case["lora"][1]) if case.get("lora") else None
req = Request(request_id="r", prompt_token_ids=case["ids"], sampling_params=SamplingParams(max_tokens=1),
              pooling_params=None, cache_salt=case.get("salt"), lora_request=lora,
              block_hasher=ku.get_request_block_hasher(case["block_size"], fn))
print(json.dumps([h.hex() for h in req.block_hashes]))
"""


def vllm_venv():
    return next((v for v in (peers.vllm033_venv(), peers.vllm032_venv()) if v and peers.vllm_present(v)), None)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['algo']}-bs{c['block_size']}"
                         f"{'-salt' if c.get('salt') else ''}{'-lora' if c.get('lora') else ''}"
                         f"{'-seed' if c.get('seed') else ''}")
def test_equal_to_vllms_own_hasher(case):
    venv = vllm_venv()
    if venv is None:
        pytest.skip("no vLLM peer installed (bench/peers.py)")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VLLM_TARGET_DEVICE": "cpu"}
    if case.get("seed"):
        env["PYTHONHASHSEED"] = case["seed"]
    out = subprocess.run([str(venv / "bin/python"), "-c", VLLM_HASHER], input=json.dumps(case), env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ours(case)


CHAT = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "tell me about the sea " * 12}]}


@pytest.fixture(scope="module")
def server():
    with RenderServer(qwen3_config(False)) as srv:
        yield srv


def test_render_hands_out_the_hashes_of_the_ids_it_rendered_when_asked(server):
    plain = server.client.post("/v1/chat/completions/render", json=CHAT).json()
    assert "block_hashes" not in plain
    for salt in (None, "tenant-a"):
        got = server.client.post("/v1/chat/completions/render",
                                 json={**CHAT, "return_block_hashes": True, "cache_salt": salt}).json()
        want = [external_hash(h) for h in block_hashes(got["token_ids"], BlockHashConfig(16), cache_salt=salt)]
        assert got["block_hashes"] == want and len(want) == len(got["token_ids"]) // 16 > 0
    completion = server.client.post("/v1/completions/render", json={
        "model": "qwen3-0.6b", "prompt": ["one two three " * 10, "four"], "return_block_hashes": True}).json()
    assert [c["block_hashes"] for c in completion] == [
        [external_hash(h) for h in block_hashes(c["token_ids"], BlockHashConfig(16))] for c in completion]
    assert completion[1]["block_hashes"] == []
