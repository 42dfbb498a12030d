"""`token-engine preflight`: protocol detection from UCX_PROTO_INFO tables, verdict rules, and one real run
between two local agents (tiny geometry so it stays fast)."""

import json
import subprocess
import sys

from token_engine.kv_tools.preflight import protocols_from, verdict

# Shapes of UCX 1.23's UCX_PROTO_INFO=y tables, as printed by a decode probe on this box.
CMA_TABLES = """\
[1795984743.806127] [vm:29834:0]   | preflight-decode-29834 self cfg#0                                                |
[1795984743.806127] [vm:29834:0]   | active message by ucp_am_send* with reply flag(fast-completion) from host memory |
[1795984743.806127] [vm:29834:0]   |   0..8176 | short              | tcp/lo                                          |
[1795984743.828510] [vm:29834:0]   | remote memory read by ucp_get* from host memory to host |
[1795984743.828510] [vm:29834:0]   | Range  | Description |              Config               |
[1795984743.828510] [vm:29834:0]   | 0..inf | zero-copy   | cma/memory                        |
"""
EMULATED_TABLES = """\
[1.0] [gpu:1:0]   | remote memory read by ucp_get* from cuda/dev[1] to cuda |
[1.0] [gpu:1:0]   | 0..inf | software emulation | tcp/lo |
"""


def test_read_protocol_comes_from_the_get_table_only():
    # tcp/lo carries active messages (notifications) but READs go over cma
    assert protocols_from(CMA_TABLES) == ["cma"]
    assert set(protocols_from(EMULATED_TABLES)) == {"emulation", "tcp"}
    assert protocols_from("no tables here") == []


def test_verdicts():
    assert verdict({}, ["cma"], "cpu")[0] == "OK"
    assert verdict({}, ["tcp"], "cpu")[0] == "WARN"
    assert verdict({}, ["cuda_ipc"], "cuda:1")[0] == "OK"
    status, why = verdict({}, ["emulation", "tcp"], "cuda:1")
    assert status == "WARN" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in why


def test_preflight_runs_between_two_local_agents():
    out = subprocess.run(
        [sys.executable, "-m", "token_engine.cli", "preflight", "--layers", "2", "--heads", "2", "--head-dim", "16",
         "--large-blocks", "16", "--repeats", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["verdict"] in ("OK", "WARN"), result
    assert result["protocols"], "UCX reported no READ protocol"
    assert result["contiguous_descriptors"] == 1
    assert result["scattered_descriptors"] > 8  # a shuffled run rarely merges
    assert result["one_block_gbps"] > 0 and result["contiguous_gbps"] > 0
