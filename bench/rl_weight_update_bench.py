"""Time one full weight update of a model shape, trainer process -> engine parameters, and say where it goes.

    python -m bench.rl_weight_update_bench --preset qwen2.5-7b --transport ipc          # one GPU, CUDA IPC
    python -m bench.rl_weight_update_bench --preset qwen2.5-7b --transport broadcast \
        --device cuda:0 --trainer-device cuda:1                                        # NCCL, two GPUs
    python -m bench.rl_weight_update_bench --preset tiny --transport broadcast --device cpu   # gloo smoke

The trainer is a second process holding the checkpoint-named (unfused) tensors in bfloat16; the engine side is
the receiver the /update_weights route runs (token_engine.rl.transfer) writing into the fused parameters of a
model of the preset's shape. Baseline in the same run: copying the same tensors from a buffer already in the
engine's own memory into the parameters (the floor any transport can reach). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import time

import torch
import torch.multiprocessing as mp


def _shapes(preset: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    from token_engine.models.random_model import checkpoint_shapes, random_model_config

    config, _ = random_model_config("qwen3", preset, None, "bfloat16")
    return config, checkpoint_shapes(config)


def _trainer(preset: str, device: str, transport: str, queue, done, init_info) -> None:
    _, shapes = _shapes(preset)
    names = sorted(shapes)
    tensors = {n: torch.randn(shapes[n], device=device, dtype=torch.bfloat16) for n in names}
    if transport == "ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
        handles = [{uuid: reduce_tensor(tensors[n])[1]} for n in names]
        queue.put(base64.b64encode(pickle.dumps(handles)).decode())
        done.wait()
        return
    from token_engine.rl.trainer import TrainerGroup

    group = TrainerGroup("127.0.0.1", 0, backend="nccl" if device.startswith("cuda") else "gloo")
    queue.put(group.store.port)
    group.connect()
    for _ in range(init_info["rounds"]):
        done.wait()
        done.clear()
        group.broadcast(tensors[n] for n in names)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        queue.put("sent")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--transport", choices=("ipc", "broadcast"), default="ipc")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--trainer-device", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from token_engine.models import build_model
    from token_engine.models.arch import arch_from_config
    from token_engine.rl.trainer import update_info
    from token_engine.rl.transfer import DistributedReceiver, IpcReceiver
    from token_engine.rl.weights import WeightTable

    config, shapes = _shapes(args.preset)
    names = sorted(shapes)
    device = torch.device(args.device)
    model = build_model(arch_from_config(config, dtype=torch.bfloat16), device)
    table = WeightTable(model)
    total_bytes = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    meta = update_info([(n, torch.empty(shapes[n], dtype=torch.bfloat16, device="meta")) for n in names])

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    trainer_device = args.trainer_device or args.device
    proc = ctx.Process(target=_trainer, args=(args.preset, trainer_device, args.transport, queue, done,
                                              {"rounds": args.rounds}))
    proc.start()
    times, where = [], {}
    if args.transport == "ipc":
        import os

        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        pickled = queue.get(timeout=600)
        receiver = IpcReceiver({}, device)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            receiver.receive(table, {**meta, "ipc_handles_pickled": pickled})
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        table.plan(meta["names"], meta["dtype_names"], meta["shapes"])
        where["plan_s"] = time.perf_counter() - t0
        done.set()
    else:
        port = queue.get(timeout=600)
        import threading

        box: dict = {}
        joiner = threading.Thread(target=lambda: box.setdefault("r", DistributedReceiver(
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}, device)))
        joiner.start()
        joiner.join(600)
        receiver = box["r"]
        for _ in range(args.rounds):
            done.set()
            t0 = time.perf_counter()
            receiver.receive(table, meta)
            times.append(time.perf_counter() - t0)
            queue.get(timeout=600)
    proc.join(600)

    # the floor: the same bytes copied from the engine's own memory into the parameters
    local = {n: torch.randn(shapes[n], device=device, dtype=torch.bfloat16) for n in names}
    plan = table.plan(meta["names"], meta["dtype_names"], meta["shapes"])
    floors = []
    for _ in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for dest in plan:
            table.write(dest, local[dest.name])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        floors.append(time.perf_counter() - t0)
    best, floor = min(times), min(floors)
    print(json.dumps({
        "preset": args.preset, "transport": args.transport, "device": str(device), "tensors": len(names),
        "gbytes": round(total_bytes / 1e9, 3), "update_s": [round(t, 4) for t in times],
        "local_copy_floor_s": [round(t, 4) for t in floors], "ratio_to_floor": round(best / floor, 2),
        "effective_gb_per_s": round(total_bytes / best / 1e9, 1), **{k: round(v, 4) for k, v in where.items()},
    }))


if __name__ == "__main__":
    main()
