"""The trainer's side of a weight push, for trainers written against torch and for the tests that play one.

    group = TrainerGroup("127.0.0.1", port)            # rank 0; hosts the rendezvous
    with ThreadPoolExecutor(1) as pool:                 # the engine joins while we wait in connect()
        joined = pool.submit(http.post, "/init_weight_transfer_engine", json={"init_info": group.init_info()})
        group.connect()
        joined.result()
    push_weights(http, group, model.named_parameters(), version="step-1")

The broadcasts must run while the engine's ``/update_weights`` call is open, so the HTTP call goes out on a
thread and the tensors follow on this one.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from token_engine.rl.transfer import STORE_PREFIX


def update_info(named: list[tuple[str, torch.Tensor]], src: int = 0) -> dict[str, Any]:
    """vLLM's update_info for a broadcast round: names, dtype names and shapes, in send order."""
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "src": src, "packed": False}


class TrainerGroup:
    """Rank 0 of a broadcast group with one engine (rank 1): gloo for CPU tensors, NCCL for CUDA ones."""

    def __init__(self, master_address: str, master_port: int, world_size: int = 2, backend: str = "gloo",
                 timeout_s: float = 60.0):
        self.master_address, self.master_port, self.world_size = master_address, master_port, world_size
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = torch.distributed.TCPStore(master_address, master_port, world_size, True,
                                                timeout=self.timeout, wait_for_workers=False)
        self.group: Any = None

    def init_info(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.store.port,
                "rank_offset": 1, "world_size": self.world_size, "packed": False}

    def connect(self) -> None:
        """Blocks until every engine rank has joined."""
        prefixed = torch.distributed.PrefixStore(STORE_PREFIX, self.store)
        if self.backend == "gloo":
            self.group = torch.distributed.ProcessGroupGloo(prefixed, 0, self.world_size, self.timeout)
        else:
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = torch.distributed.ProcessGroupNCCL(prefixed, 0, self.world_size, options)

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self.group.broadcast([tensor.contiguous()], options).wait()


def push_weights(http, group: TrainerGroup, named: Iterable[tuple[str, torch.Tensor]], version: str | None = None,
                 chunk: int = 0) -> None:
    """start_weight_update, update_weights (one round, or rounds of ``chunk`` tensors), finish_weight_update.
    ``http`` is an httpx.Client on the engine (base_url and API key set). Raises on a refused call."""
    named = [(n, t.detach()) for n, t in named]
    http.post("/start_weight_update", json={"is_checkpoint_format": True}).raise_for_status()
    rounds = [named[i:i + chunk] for i in range(0, len(named), chunk)] if chunk else [named]
    with ThreadPoolExecutor(1) as pool:
        for part in rounds:
            answer = pool.submit(http.post, "/update_weights", json={"update_info": update_info(part)})
            group.broadcast(t for _, t in part)
            answer.result().raise_for_status()
    http.post("/finish_weight_update", json={"weight_version": version}).raise_for_status()
