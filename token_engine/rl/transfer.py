"""Receivers of a trainer's tensors: a torch.distributed broadcast group (gloo on CPU, NCCL on GPU) or CUDA IPC.

Distributed: the trainer is rank 0 and hosts a TCPStore at ``master_address:master_port``; the engine joins as
``rank_offset`` of ``world_size`` (one engine process is one rank, so ``world_size`` must be ``rank_offset + 1``).
Each ``update_weights`` call then receives the listed tensors in order, each broadcast from ``src``. vLLM's own
trainer helper rendezvouses through its StatelessProcessGroup instead; a torch.distributed trainer (ours,
``token_engine.rl.trainer``) speaks this one.

IPC: the trainer shares tensors on the same GPU as ``torch.multiprocessing.reductions.reduce_tensor`` handles
keyed by GPU UUID, pickled and base64-encoded (vLLM's ``ipc_handles_pickled``). Unpickling is refused unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (as vLLM), and even then only the CUDA tensor rebuild is unpicklable.
"""

from __future__ import annotations

import base64
import datetime
import io
import os
import pickle
from typing import Any

import torch

from token_engine.rl.weights import WIRE_DTYPES, Destination, WeightTable, WeightUpdateError

RENDEZVOUS_TIMEOUT_S = 60.0
STORE_PREFIX = "weight-transfer/"


def _int(info: dict, key: str, default: int | None = None) -> int:
    value = info.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WeightUpdateError(f"init_info.{key} must be a non-negative integer, got {value!r}", param=key)
    return value


class DistributedReceiver:
    """The engine's rank in a trainer's broadcast group."""

    kind = "nccl"

    def __init__(self, init_info: dict, device: torch.device):
        address = init_info.get("master_address")
        if not isinstance(address, str) or not address:
            raise WeightUpdateError("init_info.master_address is required for the nccl backend",
                                    param="master_address")
        port = _int(init_info, "master_port")
        if not 0 < port < 65536:
            raise WeightUpdateError(f"init_info.master_port {port} is not a port", param="master_port")
        world_size = _int(init_info, "world_size")
        rank = _int(init_info, "rank_offset", 1)
        if rank < 1 or world_size != rank + 1:
            raise WeightUpdateError(
                f"world_size {world_size} does not match this engine: it is one rank, joining at rank_offset "
                f"{rank} after the trainer's rank(s), so world_size must be rank_offset + 1 = {rank + 1}",
                param="world_size")
        if init_info.get("packed"):
            raise WeightUpdateError("packed broadcasts are not supported: send with packed=false", param="packed")
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=float(init_info.get("timeout_s", RENDEZVOUS_TIMEOUT_S)))
        try:
            store = torch.distributed.TCPStore(address, port, world_size, False, timeout=timeout)
            prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
            if self.backend == "gloo":
                self.group: Any = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            else:
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.group = torch.distributed.ProcessGroupNCCL(prefixed, rank, world_size, options)
        except (RuntimeError, OSError) as exc:
            raise WeightUpdateError(f"cannot join the trainer's group at {address}:{port}: {exc}",
                                    status=502, param="master_address") from None
        self._last: tuple[list, list, list] | None = None

    def receive(self, table: WeightTable, update_info: dict) -> int:
        names, dtypes, shapes = (update_info.get("names") or [], update_info.get("dtype_names") or [],
                                 update_info.get("shapes") or [])
        if not names and self._last is not None:  # vLLM: empty lists reuse the previous round's metadata
            names, dtypes, shapes = self._last
        src = _int(update_info, "src", 0)
        if src >= self.rank:
            raise WeightUpdateError(f"src {src} is not a trainer rank (trainer ranks are below {self.rank})",
                                    param="src")
        plan = table.plan(names, dtypes, shapes)
        options = torch.distributed.BroadcastOptions()
        options.rootRank = src
        for dest in plan:
            buf = self._buffer(dest)
            self.group.broadcast([buf], options).wait()
            if buf is not dest.view():
                table.write(dest, buf)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._last = (names, dtypes, shapes)
        return len(plan)

    def _buffer(self, dest: Destination) -> torch.Tensor:
        view = dest.view()
        if self.backend == "nccl" and view.dtype == dest.dtype and view.is_contiguous():
            return view  # straight into the live parameter
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        return torch.empty(dest.shape, dtype=dest.dtype, device=device)

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError:
                pass


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles IPC handle tuples and nothing else that could run code."""

    # reduce_tensor names the tensor's typed storage class (TypedStorage since torch 2.0), or an untyped one
    ALLOWED = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Size"), ("torch", "Tensor"),
               ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
               ("torch", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "TypedStorage"),
               ("builtins", "tuple"), ("builtins", "dict")}
    DTYPES = frozenset(WIRE_DTYPES)

    def find_class(self, module: str, name: str):
        # reduce_tensor's args: tensor class, Size, storage class, dtype, handles as bytes
        if (module, name) in self.ALLOWED or (module == "torch" and name in self.DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in IPC handles")


class IpcReceiver:
    """Rebuilds a same-GPU trainer's shared tensors and copies them into the live parameters."""

    kind = "ipc"

    def __init__(self, init_info: dict, device: torch.device):
        if device.type != "cuda":
            raise WeightUpdateError("the ipc backend needs the engine on a CUDA device", param="init_info")
        if init_info.get("packed"):
            raise WeightUpdateError("packed IPC buffers are not supported: send with packed=false", param="packed")
        self.device = device

    def receive(self, table: WeightTable, update_info: dict) -> int:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        plan = table.plan(update_info.get("names") or [], update_info.get("dtype_names") or [],
                          update_info.get("shapes") or [])
        pickled = update_info.get("ipc_handles_pickled")
        if not isinstance(pickled, str):
            raise WeightUpdateError("update_info.ipc_handles_pickled (base64 pickle) is required",
                                    param="ipc_handles_pickled")
        if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise WeightUpdateError("refusing to unpickle ipc_handles_pickled without "
                                    "VLLM_ALLOW_INSECURE_SERIALIZATION=1", status=403, param="ipc_handles_pickled")
        try:
            handles = _HandleUnpickler(io.BytesIO(base64.b64decode(pickled, validate=True))).load()
        except Exception as exc:  # noqa: BLE001 - any malformed or disallowed payload is the caller's
            raise WeightUpdateError(f"ipc_handles_pickled does not decode: {exc}",
                                    param="ipc_handles_pickled") from None
        if not isinstance(handles, list) or len(handles) != len(plan):
            raise WeightUpdateError("ipc_handles_pickled must hold one handle per name", param="ipc_handles_pickled")
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        tensors = []
        for dest, handle in zip(plan, handles):
            if not isinstance(handle, dict) or uuid not in handle:
                raise WeightUpdateError(f"no IPC handle for this GPU ({uuid}) for {dest.name!r}",
                                        param="ipc_handles_pickled")
            args = list(handle[uuid])
            args[6] = self.device.index or 0  # the receiver's device index, as vLLM does
            tensor = rebuild_cuda_tensor(*args)
            if tuple(tensor.shape) != dest.shape or tensor.dtype != dest.dtype:
                raise WeightUpdateError(f"IPC tensor for {dest.name!r} is {tensor.dtype} {list(tensor.shape)}, "
                                        f"declared {dest.dtype} {list(dest.shape)}", param="ipc_handles_pickled")
            tensors.append(tensor)
        for dest, tensor in zip(plan, tensors):  # every handle checked before the first write
            table.write(dest, tensor)
        torch.cuda.synchronize(self.device)
        return len(plan)

    def close(self) -> None:
        pass


def create_receiver(backend: str, init_info: dict, device: torch.device):
    if backend == "nccl":
        return DistributedReceiver(init_info, device)
    if backend == "ipc":
        return IpcReceiver(init_info, device)
    raise WeightUpdateError(f"unknown weight transfer backend {backend!r} (nccl or ipc)", param="backend")
