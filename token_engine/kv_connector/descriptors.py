"""KV pool geometry and NIXL descriptor building for block-major pools.

The engine's pool is `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so one block across
all layers is one contiguous region of `block_bytes`. A request's handoff is a list of (local block, remote
block) pairs; every run where both sides are consecutive becomes ONE descriptor. NIXL's cost follows the
descriptor count, not the bytes (nixl.md §4), so this is what keeps an 8k-token handoff cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one engine's KV pool; two engines can hand off blocks only if all but num_blocks match."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def compatible_with(self, other: KVGeometry) -> bool:
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool lives: base address, geometry, NIXL memory type and device id."""

    base_addr: int
    geometry: KVGeometry
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.geometry.block_bytes


def geometry_of(kv_pool) -> KVGeometry:
    """Read the geometry of a torch KV pool laid out as the engine contract says."""
    if kv_pool.dim() != 6 or kv_pool.shape[2] != 2:
        raise ValueError(f"kv_pool must be [blocks, layers, 2, block_size, heads, dim], got {tuple(kv_pool.shape)}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous so that a block is one region")
    dtype = str(kv_pool.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    n, layers, _, bs, heads, dim = kv_pool.shape
    return KVGeometry(int(n), int(layers), int(bs), int(heads), int(dim), dtype)


def layout_of(kv_pool) -> PoolLayout:
    device_id = kv_pool.get_device()
    return PoolLayout(
        base_addr=int(kv_pool.data_ptr()),
        geometry=geometry_of(kv_pool),
        mem_type="DRAM" if device_id < 0 else "VRAM",
        device_id=max(device_id, 0),
    )


def block_runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """Merge pairwise block ids into runs (local_start, remote_start, count), both sides consecutive."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lo, re in zip(local_ids, remote_ids):
        if runs:
            ls, rs, n = runs[-1]
            if lo == ls + n and re == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lo, re, 1))
    return runs


def check_block_ids(block_ids: list[int], geometry: KVGeometry, side: str) -> None:
    """Reject ids outside the pool or repeated: a repeated id would read one block twice into two slots."""
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{side} block ids repeat")
    for b in block_ids:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < geometry.num_blocks:
            raise ValueError(f"{side} block id {b!r} outside [0, {geometry.num_blocks})")


def read_descriptors(local: PoolLayout, remote: PoolLayout, local_ids: list[int], remote_ids: list[int]):
    """Nx3 (addr, len, dev) arrays for a READ of remote blocks into local blocks, one row per merged run."""
    if not local.geometry.compatible_with(remote.geometry):
        raise ValueError(f"KV geometry mismatch: local {local.geometry} remote {remote.geometry}")
    check_block_ids(local_ids, local.geometry, "local")
    check_block_ids(remote_ids, remote.geometry, "remote")
    runs = block_runs(local_ids, remote_ids)
    bb = local.geometry.block_bytes
    local_descs = np.empty((len(runs), 3), dtype=np.uint64)
    remote_descs = np.empty((len(runs), 3), dtype=np.uint64)
    for i, (ls, rs, n) in enumerate(runs):
        local_descs[i] = (local.block_addr(ls), n * bb, local.device_id)
        remote_descs[i] = (remote.block_addr(rs), n * bb, remote.device_id)
    return local_descs, remote_descs
