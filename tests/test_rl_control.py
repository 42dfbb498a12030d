"""The trainer routes on a real engine over HTTP: pause (keep, abort, wait) and resume, abort_requests, weight
updates refused whole on bad input, sleep, reload from a checkpoint, and weight_versions spans across an update."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from splitserve_common.auth import ApiKeys
from tests.engine_harness import engine_config, single_threaded_server, wait_for_idle_blocks, write_tiny_qwen3
from tests.rl_trainer_process import training_step
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.models.loader import iter_checkpoint
from token_engine.rl.trainer import TrainerGroup, push_weights, update_info

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]
LONG = 900  # output tokens of a request that is still running when the test pauses or aborts it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("rl") / "model")


def long_config(model_dir):
    return engine_config(model_dir, max_model_len=1024, num_gpu_blocks_override=700)


def body(max_tokens, **extra):
    return {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": max_tokens,
                                                     "ignore_eos": True, "logprobs": 0}, **extra}


def until(predicate, what: str, attempts: int = 2000):
    for _ in range(attempts):  # bounded: a hang fails the test
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"never: {what}")


def outputs_so_far(srv) -> list[int]:
    return [s.num_output_tokens for st in list(srv.llm.requests.values()) for s in st.seqs]


class Background:
    """A generate call on its own thread (unary, or a stream read to its end)."""

    def __init__(self, srv, payload):
        self.result: dict = {}
        self.thread = threading.Thread(target=self._run, args=(srv.url, payload), daemon=True)
        self.thread.start()

    def _run(self, url, payload):
        with httpx.Client(base_url=url, timeout=120) as c:
            if not payload.get("stream"):
                r = c.post("/inference/v1/generate", json=payload)
                self.result = {"status": r.status_code, "json": r.json()}
                return
            events = []
            with c.stream("POST", "/inference/v1/generate", json=payload) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            self.result = {"status": r.status_code, "events": events}

    def join(self) -> dict:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self.result


def test_routes_are_off_unless_asked_and_behind_the_key(model_dir, monkeypatch):
    with single_threaded_server(engine_config(model_dir)) as srv, srv.client() as c:
        assert c.post("/pause").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with single_threaded_server(engine_config(model_dir), api_keys=ApiKeys(["k"])) as srv, srv.client() as c:
        assert c.get("/is_paused").status_code == 401
        r = c.get("/is_paused", headers={"Authorization": "Bearer k"})
        assert r.json() == {"is_paused": False}
        assert c.get("/get_world_size", headers={"Authorization": "Bearer k"}).json() == {"world_size": 1}


def test_pause_keep_freezes_requests_and_resume_continues_them(model_dir):
    with single_threaded_server(long_config(model_dir), rl_control=True) as srv, srv.client() as c:
        reference = c.post("/inference/v1/generate", json=body(200)).json()["choices"][0]
        job = Background(srv, body(200))
        until(lambda: any(n > 0 for n in outputs_so_far(srv)), "the request produced tokens")
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert c.get("/is_paused").json() == {"is_paused": True}
        c.post("/weight_checker", json={"action": "checksum"})  # a round trip through the engine thread
        frozen = outputs_so_far(srv)
        c.post("/weight_checker", json={"action": "checksum"})
        assert outputs_so_far(srv) == frozen and 0 < frozen[0] < 200
        assert c.post("/resume").json() == {"status": "resumed"}
        result = job.join()["json"]["choices"][0]
        assert result["token_ids"] == reference["token_ids"] and result["finish_reason"] == "length"
        assert wait_for_idle_blocks(srv.llm) == srv.llm.num_blocks


def test_pause_abort_ends_unary_and_streamed_requests_keeping_their_tokens(model_dir):
    with single_threaded_server(long_config(model_dir), rl_control=True) as srv, srv.client() as c:
        first = c.post("/inference/v1/generate", json=body(8)).json()["choices"][0]["token_ids"]
        unary = Background(srv, body(LONG))
        stream = Background(srv, body(LONG, stream=True))
        until(lambda: len(outputs_so_far(srv)) == 2 and min(outputs_so_far(srv)) >= 8, "both produced tokens")
        assert c.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
        refused = c.post("/inference/v1/generate", json=body(4))
        assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]

        choice = unary.join()["json"]["choices"][0]
        assert choice["finish_reason"] == "abort"
        assert 8 <= len(choice["token_ids"]) < LONG and choice["token_ids"][:8] == first
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert choice["weight_versions"][0]["end"] == len(choice["token_ids"])

        events = stream.join()["events"]
        chunks = [ch for e in events for ch in e["choices"]]
        tokens = [t for ch in chunks for t in ch["token_ids"]]
        assert chunks[-1]["finish_reason"] == "abort" and 8 <= len(tokens) < LONG and tokens[:8] == first
        assert sum(len(ch["logprobs"]["content"]) for ch in chunks) == len(tokens)

        assert c.post("/resume").status_code == 200
        assert c.post("/inference/v1/generate", json=body(8)).json()["choices"][0]["token_ids"] == first
        assert wait_for_idle_blocks(srv.llm) == srv.llm.num_blocks


def test_pause_wait_lets_requests_finish_and_refuses_new_ones(model_dir):
    with single_threaded_server(long_config(model_dir), rl_control=True) as srv, srv.client() as c:
        job = Background(srv, body(120))
        until(lambda: bool(outputs_so_far(srv)), "the request is running")
        assert c.post("/pause", params={"mode": "wait"}).status_code == 200
        assert job.join()["json"]["choices"][0]["finish_reason"] == "length"  # done before /pause answered
        assert c.post("/inference/v1/generate", json=body(4)).status_code == 503
        assert c.post("/pause", params={"mode": "later"}).status_code == 400
        c.post("/resume")
        assert c.post("/inference/v1/generate", json=body(4)).status_code == 200


def test_abort_requests_reaches_a_whole_group_and_an_empty_list_aborts_everything(model_dir):
    with single_threaded_server(long_config(model_dir), rl_control=True) as srv, srv.client() as c:
        group = [Background(srv, {**body(LONG), "request_id": "grp-7", "sampling_params": {
            "temperature": 1.0, "seed": i, "n": 2, "max_tokens": LONG, "ignore_eos": True}}) for i in range(2)]
        other = Background(srv, body(LONG))
        until(lambda: len(outputs_so_far(srv)) == 5 and min(outputs_so_far(srv)) > 0, "all five sequences run")
        assert c.post("/abort_requests", json={"request_ids": ["grp-7"]}).json() == {"status": "aborted",
                                                                                   "aborted": 1}
        for job in group:
            choices = job.join()["json"]["choices"]
            assert [ch["finish_reason"] for ch in choices] == ["abort", "abort"]
            assert all(ch["token_ids"] for ch in choices)
        assert len(outputs_so_far(srv)) == 1  # the other request still runs
        assert c.post("/abort_requests", json={"request_ids": []}).json() == {"status": "aborted", "aborted": 1}
        assert other.join()["json"]["choices"][0]["finish_reason"] == "abort"
        assert c.post("/abort_requests", json={"request_ids": "grp-7"}).status_code == 400
        assert wait_for_idle_blocks(srv.llm) == srv.llm.num_blocks


def _init_group(c) -> TrainerGroup:
    group = TrainerGroup("127.0.0.1", 0)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", c.post("/init_weight_transfer_engine",
                                                                   json={"init_info": group.init_info()})))
    t.start()
    group.connect()
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    return group


def test_bad_updates_are_refused_naming_the_problem_and_the_old_weights_stay(model_dir):
    with single_threaded_server(engine_config(model_dir), rl_control=True) as srv, srv.client() as c:
        before = c.post("/inference/v1/generate", json=body(10)).json()["choices"][0]["token_ids"]
        sums = c.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]

        def refused(path, payload, status, words):
            r = c.post(path, json=payload)
            assert r.status_code == status, r.text
            message = r.json()["error"]["message"]
            assert all(w in message for w in words), message

        refused("/start_weight_update", {}, 409, ["init_weight_transfer_engine"])
        refused("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                               "rank_offset": 1, "world_size": 3}},
                400, ["world_size 3"])
        refused("/init_weight_transfer_engine", {}, 400, ["init_info"])
        group = _init_group(c)
        refused("/update_weights", {"update_info": update_info([])}, 409, ["start_weight_update"])
        assert c.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
        q = torch.zeros(srv.llm.arch.num_heads * srv.llm.arch.head_dim, srv.llm.arch.hidden_size)
        refused("/update_weights", {"update_info": update_info([("model.layers.0.self_attn.qq_proj.weight", q)])},
                400, ["unknown parameter", "qq_proj"])
        refused("/update_weights", {"update_info": update_info([("model.layers.0.self_attn.q_proj.weight",
                                                                 q[:, :3])])}, 400, ["q_proj", "shape"])
        bad_dtype = update_info([("model.layers.0.self_attn.q_proj.weight", q)])
        bad_dtype["dtype_names"] = ["int8"]
        refused("/update_weights", {"update_info": bad_dtype}, 400, ["dtype", "int8"])
        mixed = update_info([("model.norm.weight", torch.zeros(srv.llm.arch.hidden_size)),
                             ("lm_head.weight", torch.zeros(3, 3))])
        refused("/update_weights", {"update_info": mixed}, 400, ["lm_head.weight", "shape"])
        refused("/update_weights", {"update_info": "x"}, 400, ["update_info"])
        assert c.post("/finish_weight_update", json={"weight_version": "never"}).status_code == 200
        assert c.post("/weight_checker", json={"action": "compare", "baseline": sums}).json() == {
            "match": True, "mismatches": []}
        assert c.post("/inference/v1/generate", json=body(10)).json()["choices"][0]["token_ids"] == before

        # asleep: updates are a 409, generation a 503; awake again, the same group pushes a real update
        assert c.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        refused("/start_weight_update", {}, 409, ["asleep", "wake_up"])
        refused("/update_weights", {"update_info": update_info([])}, 409, ["asleep"])
        assert c.post("/inference/v1/generate", json=body(4)).status_code == 503
        assert c.post("/wake_up").json() == {"status": "awake", "tags": None}
        weights = training_step(dict(iter_checkpoint(model_dir)), seed=5)
        push_weights(c, group, sorted(weights.items()), version="v2")
        assert c.get("/weight_info").json() == {"weight_version": "v2"}
        assert c.post("/inference/v1/generate", json=body(10)).json()["choices"][0]["token_ids"] != before
        assert c.post("/weight_checker", json={"action": "compare"}).status_code == 400
        assert c.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
        zeroed = c.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert all(zeroed[n] != sums[n] for n in sums)
        c.post("/shutdown_weight_transfer_engine")


def _perturbed_checkpoint(model_dir, out_dir):
    from safetensors.torch import save_file

    out_dir.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            (out_dir / path.name).write_bytes(path.read_bytes())
    new = training_step(dict(iter_checkpoint(model_dir)), seed=9)
    save_file({n: t.float().contiguous() for n, t in new.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def test_reload_mid_request_labels_tokens_and_never_serves_old_prefix_kv(model_dir, tmp_path):
    updated = _perturbed_checkpoint(model_dir, tmp_path / "updated")
    fresh = LLMEngine(engine_config(updated, max_model_len=1024, num_gpu_blocks_override=700))
    want = fresh.generate([PROMPT + PROMPT], SamplingOptions(temperature=0, max_tokens=10, ignore_eos=True))[0]
    fresh.shutdown()
    with single_threaded_server(long_config(model_dir), rl_control=True) as srv, srv.client() as c:
        c.post("/inference/v1/generate", json={**body(4), "token_ids": PROMPT + PROMPT})  # fills the prefix cache
        job = Background(srv, body(200, stream=True))
        until(lambda: any(n > 0 for n in outputs_so_far(srv)), "the request produced tokens")
        c.post("/pause", params={"mode": "keep"})
        c.post("/weight_checker", json={"action": "checksum"})  # the step under way has ended
        k = outputs_so_far(srv)[0]
        r = c.post("/collective_rpc", json={"method": "reload_weights",
                                            "kwargs": {"weights_path": str(updated), "weight_version": "v2"}})
        assert r.json() == {"results": [None]}
        c.post("/resume")
        last = [ch for e in job.join()["events"] for ch in e["choices"] if ch["finish_reason"]][-1]
        assert last["weight_versions"] == [{"version": "default", "start": 0, "end": k},
                                           {"version": "v2", "start": k, "end": 200}]
        again = c.post("/inference/v1/generate", json={**body(10), "token_ids": PROMPT + PROMPT}).json()
        assert again["choices"][0]["token_ids"] == want
        assert again["choices"][0]["weight_versions"] == [{"version": "v2", "start": 0, "end": 10}]
        bad = c.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}})
        assert bad.status_code == 400 and "checkpoint" in bad.json()["error"]["message"]
        assert c.post("/collective_rpc", json={"method": "execute_model"}).status_code == 400
        assert c.post("/reset_prefix_cache").json() == {"success": True}


def test_a_group_computes_its_prompt_once(model_dir):
    """n samples and duplicate ids of one prompt: the prompt's KV is computed once, the rest come from cache."""
    prompt = list(range(40, 81))  # 41 tokens: 10 full blocks of 4 can be shared, the last token always runs
    with single_threaded_server(long_config(model_dir), rl_control=True,
                                enable_prompt_tokens_details=True) as srv, srv.client() as c:
        c.post("/pause", params={"mode": "keep"})  # the whole group arrives before the first step
        jobs = [Background(srv, {"token_ids": prompt, "request_id": "group-1", "sampling_params": {
            "n": 3, "temperature": 1.0, "seed": i, "max_tokens": 4, "ignore_eos": True}}) for i in range(2)]
        until(lambda: sum(len(st.seqs) for st in list(srv.llm.requests.values())) == 6, "the group is queued")
        c.post("/resume")
        usages = [job.join()["json"]["usage"] for job in jobs]
        stats = c.get("/debug/kv_cache").json()
        assert stats["prefix_cache_queries"] == 6 * 41
        assert stats["prefix_cache_hits"] == 5 * 40  # five of six took the 40 shareable tokens from the first
        # usage reports choice 0: the leader computed its prompt, the duplicate request took it from the cache
        assert sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usages) == [0, 40]


def test_ipc_handles_refuse_anything_but_a_cuda_tensor_rebuild(model_dir, monkeypatch):
    import io
    import os
    import pickle

    from token_engine.rl.transfer import _HandleUnpickler

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        _HandleUnpickler(io.BytesIO(pickle.dumps([{"gpu": Payload()}]))).load()
    # what reduce_tensor puts in a CUDA tensor's handle: its classes, shape, dtype and the handle bytes
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    args = (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 0, b"handle", 12, 0, False,
            b"refcount", 0, b"event", True)
    assert type(t._typed_storage()) is torch.storage.TypedStorage
    assert _HandleUnpickler(io.BytesIO(pickle.dumps([{"gpu": args}]))).load() == [{"gpu": args}]
    # the route's own refusals, on this CPU engine
    with single_threaded_server(engine_config(model_dir), rl_control=True) as srv, srv.client() as c:
        r = c.post("/init_weight_transfer_engine", json={"init_info": {}})
        assert r.status_code == 400 and "CUDA" in r.json()["error"]["message"]
        r = c.post("/init_weight_transfer_engine", json={"init_info": {}, "backend": "rdma"})
        assert r.status_code == 400 and "rdma" in r.json()["error"]["message"]


def test_the_serve_flag_switches_the_routes_either_way():
    from token_engine.cli import build_parser
    from token_engine.rl.routes import rl_control_enabled

    parse = build_parser().parse_args
    assert parse(["serve", "/m"]).enable_rl_control is None
    assert parse(["serve", "/m", "--enable-rl-control"]).enable_rl_control is True
    off = parse(["serve", "/m", "--no-enable-rl-control"]).enable_rl_control
    assert off is False and rl_control_enabled(off) is False
