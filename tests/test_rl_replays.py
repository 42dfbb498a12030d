"""The HTTP call sequences two RL trainers send to a vLLM engine, replayed against ours: TRL's AsyncGRPO weight
sync (trl/generation/weight_transfer.py) and slime's vime engine wrapper (slime/backends/vllm_utils/
vllm_engine.py), bodies and query strings as they send them. The tensors go over our gloo broadcast group."""

from __future__ import annotations

import threading

import pytest

from tests.engine_harness import engine_config, single_threaded_server, write_tiny_qwen3
from tests.rl_trainer_process import training_step
from tests.test_rl_control import Background, outputs_so_far, until
from token_engine.core.engine import LLMEngine
from token_engine.core.sequence import SamplingOptions
from token_engine.models.loader import iter_checkpoint
from token_engine.rl.trainer import TrainerGroup, update_info

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
pytestmark = pytest.mark.slow  # ~20 s: two whole trainer sessions, each checked against a freshly started engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("replay") / "model")


def config(model_dir):
    return engine_config(model_dir, max_model_len=1024, num_gpu_blocks_override=700)


def saved(model_dir, out_dir, weights):
    from safetensors.torch import save_file

    out_dir.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            (out_dir / path.name).write_bytes(path.read_bytes())
    save_file({n: t.float().contiguous() for n, t in weights.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def fresh_greedy(model_dir, prompt, n):
    engine = LLMEngine(config(model_dir))
    out = engine.generate([prompt], SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))[0]
    engine.shutdown()
    return out


def join_group(c, init_info: dict, group: TrainerGroup) -> None:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "r", c.post("/init_weight_transfer_engine", json={"init_info": init_info})))
    t.start()
    group.connect()
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text


def send(c, group, info, tensors, **post):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", c.post("/update_weights", json={"update_info": info},
                                                                  **post)))
    t.start()
    group.broadcast(tensors)
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    assert out["r"].json() == {"message": "Weights updated"}


def greedy(max_tokens, prompt=PROMPT, **extra):
    return {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": max_tokens,
                                                     "ignore_eos": True, **extra}}


def test_trl_async_grpo_weight_sync(model_dir, tmp_path):
    weights = dict(iter_checkpoint(model_dir))
    steps = [training_step(weights, seed=s) for s in (1, 2)]
    with single_threaded_server(config(model_dir), rl_control=True) as srv, srv.client() as c:
        assert c.get("/health").status_code == 200
        world_size = c.get("/get_world_size").json()["world_size"] + 1
        group = TrainerGroup("127.0.0.1", 0, world_size=world_size)
        join_group(c, {"master_address": "127.0.0.1", "master_port": group.store.port, "rank_offset": 1,
                       "world_size": world_size}, group)
        names = sorted(weights)
        info = update_info([(n, steps[0][n]) for n in names])  # computed once, sent every sync
        for step in steps:
            rollouts = Background(srv, {"token_ids": PROMPT, "sampling_params": {
                "n": 2, "temperature": 1.0, "max_tokens": 40, "ignore_eos": True, "logprobs": 0}})
            until(lambda: len(outputs_so_far(srv)) == 2 and min(outputs_so_far(srv)) > 0, "rollouts run")
            assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
            assert c.post("/start_weight_update").json() == {"message": "Weight update started"}
            send(c, group, info, [step[n] for n in names])
            assert c.post("/finish_weight_update").json() == {"message": "Weight update finished"}
            assert c.post("/resume").json() == {"status": "resumed"}
            choices = rollouts.join()["json"]["choices"]
            assert all(ch["finish_reason"] == "length" and len(ch["logprobs"]["content"]) == 40 for ch in choices)
            # finish_weight_update without a version keeps the label (TRL tracks its own steps)
            assert all(ch["weight_versions"] == [{"version": "default", "start": 0, "end": 40}] for ch in choices)
        after = c.post("/inference/v1/generate", json=greedy(12)).json()["choices"][0]["token_ids"]
    assert after == fresh_greedy(saved(model_dir, tmp_path / "step2", steps[1]), PROMPT, 12)


def test_vime_rollouts_weight_sync_partial_rollout_disk_reload_and_sleep(model_dir, tmp_path):
    weights = dict(iter_checkpoint(model_dir))
    new = training_step(weights, seed=3)
    updated = saved(model_dir, tmp_path / "new", new)
    on_disk = saved(model_dir, tmp_path / "disk", training_step(weights, seed=4))
    with single_threaded_server(config(model_dir), rl_control=True) as srv, srv.client() as c:
        group = TrainerGroup("127.0.0.1", 0)
        join_group(c, {"master_address": "127.0.0.1", "master_port": group.store.port, "rank_offset": 1,
                       "world_size": 2}, group)
        # a rollout as vime sends it: logprobs 1, read from choices[0].logprobs.content[i].logprob
        r = c.post("/inference/v1/generate", json=greedy(6, logprobs=1), headers={"x-session-id": "g1"})
        assert len([e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]]) == 6

        # weight sync: pause(keep) with its query and empty body, start with is_checkpoint_format, flush, update
        assert c.post("/pause", params={"mode": "keep", "clear_cache": "false"}, json={}).status_code == 200
        assert c.post("/start_weight_update", json={"is_checkpoint_format": False}).status_code == 200
        assert c.post("/reset_prefix_cache", params={"reset_running_requests": False,
                                                     "reset_external": False}).json() == {"success": True}
        names = sorted(new)
        info = {"names": names, "dtype_names": [str(new[n].dtype).replace("torch.", "") for n in names],
                "shapes": [list(new[n].shape) for n in names], "packed": True}
        send(c, group, info, [new[n] for n in names])
        assert c.post("/finish_weight_update", json={}).status_code == 200
        assert c.post("/resume", json={}).status_code == 200
        full = fresh_greedy(updated, PROMPT, 80)
        assert c.post("/inference/v1/generate", json=greedy(80)).json()["choices"][0]["token_ids"] == full

        # a partial rollout: abort through pause(abort) + resume, then resend prompt + response so far
        job = Background(srv, greedy(80))
        until(lambda: any(n >= 5 for n in outputs_so_far(srv)), "the rollout produced tokens")
        c.post("/pause", params={"mode": "abort"})
        c.post("/resume")
        partial = job.join()["json"]["choices"][0]
        assert partial["finish_reason"] == "abort" and 5 <= len(partial["token_ids"]) < 80
        rest = c.post("/inference/v1/generate", json=greedy(80 - len(partial["token_ids"]),
                                                            prompt=PROMPT + partial["token_ids"])).json()
        assert partial["token_ids"] + rest["choices"][0]["token_ids"] == full

        # update_weights_from_disk, then release/resume memory occupation
        r = c.post("/collective_rpc", json={"method": "reload_weights",
                                            "kwargs": {"weights_path": str(on_disk), "is_checkpoint_format": True}})
        assert r.status_code == 200, r.text
        assert c.post("/inference/v1/generate", json=greedy(12)).json()["choices"][0]["token_ids"] == \
            fresh_greedy(on_disk, PROMPT, 12)
        assert c.post("/reset_prefix_cache", params={"reset_running_requests": False,
                                                     "reset_external": False}).status_code == 200
        assert c.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        woke = c.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).json()
        assert woke == {"status": "awake", "tags": ["weights", "kv_cache"]}
        assert c.get("/health").status_code == 200
        assert c.post("/inference/v1/generate", json=greedy(4)).status_code == 200
