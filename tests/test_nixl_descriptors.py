"""Descriptor building: consecutive block ids on both sides merge into one NIXL descriptor."""

import pytest
import torch

from token_engine.kv_connector.descriptors import (
    KVGeometry,
    PoolLayout,
    block_runs,
    geometry_of,
    layout_of,
    read_descriptors,
)


def _layout(base: int, blocks: int = 64, layers: int = 2) -> PoolLayout:
    return PoolLayout(base, KVGeometry(blocks, layers, 16, 2, 16, "bfloat16"), "DRAM", 0)


def test_block_bytes_is_all_layers_k_and_v_of_one_block():
    g = KVGeometry(10, 28, 16, 4, 128, "bfloat16")
    assert g.block_bytes == 28 * 2 * 16 * 4 * 128 * 2  # 917,504 bytes: the 7B shape's 16-token block


def test_geometry_of_pool_matches_contract_layout():
    pool = torch.zeros(8, 3, 2, 16, 2, 4, dtype=torch.bfloat16)
    g = geometry_of(pool)
    assert (g.num_blocks, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype) == (8, 3, 16, 2, 4, "bfloat16")
    # one block is one contiguous region: block b starts at base + b * block_bytes
    lay = layout_of(pool)
    assert pool[5].data_ptr() == lay.block_addr(5)
    assert pool[5].numel() * pool.element_size() == g.block_bytes


def test_geometry_of_rejects_layer_major_pool():
    with pytest.raises(ValueError):
        geometry_of(torch.zeros(2, 8, 16, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        geometry_of(torch.zeros(3, 8, 2, 16, 2, 4).transpose(0, 1))


def test_contiguous_request_is_one_descriptor():
    assert block_runs(list(range(10, 522)), list(range(100, 612))) == [(10, 100, 512)]


def test_runs_break_where_either_side_jumps():
    runs = block_runs([1, 2, 3, 7, 8, 9], [40, 41, 50, 51, 52, 53])
    assert runs == [(1, 40, 2), (3, 50, 1), (7, 51, 3)]


def test_read_descriptors_addresses_and_lengths():
    local, remote = _layout(1 << 20), _layout(1 << 30)
    bb = local.geometry.block_bytes
    ld, rd = read_descriptors(local, remote, [4, 5, 9], [0, 1, 2])
    assert ld.tolist() == [[(1 << 20) + 4 * bb, 2 * bb, 0], [(1 << 20) + 9 * bb, bb, 0]]
    assert rd.tolist() == [[1 << 30, 2 * bb, 0], [(1 << 30) + 2 * bb, bb, 0]]


@pytest.mark.parametrize("local_ids,remote_ids", [
    ([0, 1], [0]),            # count mismatch
    ([0, 64], [0, 1]),        # local id past the pool
    ([0, 1], [-1, 0]),        # negative remote id
    ([3, 3], [0, 1]),         # repeated local id
    ([0, 1], [True, 2]),      # bool is not a block id
])
def test_read_descriptors_rejects_bad_block_ids(local_ids, remote_ids):
    with pytest.raises(ValueError):
        read_descriptors(_layout(4096), _layout(8192), local_ids, remote_ids)


def test_read_descriptors_rejects_geometry_mismatch():
    with pytest.raises(ValueError, match="geometry"):
        read_descriptors(_layout(4096, layers=2), _layout(8192, layers=3), [0], [0])
