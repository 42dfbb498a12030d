"""--kv-transfer-config for the NixlConnector, and the KV transfer log line and metrics."""

import pytest

from token_engine.kv_connector.config import parse_nixl_config
from token_engine.kv_connector.metrics import TransferLog
from token_engine.kv_connector.nixl import BadTransferParams, parse_remote, token_hash


def test_vllm_shaped_config_is_read():
    cfg = parse_nixl_config({
        "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
        "kv_buffer_device": "cuda", "engine_id": "p0",
        "kv_connector_extra_config": {"kv_lease_duration": 12, "bidirectional_kv_xfer": False, "backends": ["UCX"]},
    }, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2"})
    assert (cfg.kv_role, cfg.load_failure_policy, cfg.lease_duration_s) == ("kv_producer", "recompute", 12.0)
    assert (cfg.engine_id, cfg.side_channel_host, cfg.side_channel_port) == ("p0", "10.0.0.2", 5601)


def test_defaults_match_vllm():
    cfg = parse_nixl_config({"kv_connector": "NixlConnector"}, env={})
    assert (cfg.kv_role, cfg.load_failure_policy, cfg.lease_duration_s, cfg.side_channel_port) == (
        "kv_both", "fail", 30.0, 5600)
    assert cfg.engine_id  # generated when not given


def test_policy_is_also_accepted_inside_extra_config():
    cfg = parse_nixl_config({"kv_connector": "NixlConnector",
                             "kv_connector_extra_config": {"kv_load_failure_policy": "recompute"}}, env={})
    assert cfg.load_failure_policy == "recompute"


@pytest.mark.parametrize("bad", [
    {"kv_connector": "Other"},
    {"kv_connector": "NixlConnector", "kv_role": "kv_sometimes"},
    {"kv_connector": "NixlConnector", "kv_load_failure_policy": "ignore"},
    {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": -1}},
    {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": "30"}},
    {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}},
    {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"bidirectional_kv_xfer": "yes"}},
    {"kv_connector": "NixlConnector", "kv_connector_extra_config": []},
])
def test_bad_configs_are_value_errors(bad):
    with pytest.raises(ValueError):
        parse_nixl_config(bad, env={})


def test_bad_side_channel_port_env():
    with pytest.raises(ValueError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        parse_nixl_config({"kv_connector": "NixlConnector"}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})


GOOD = {"do_remote_prefill": True, "remote_block_ids": [4, 5, 6], "remote_engine_id": "p", "remote_host": "h",
        "remote_port": 5600, "remote_request_id": "r", "remote_lease_epoch": (3 << 32) | 1, "tp_size": 1,
        "remote_num_tokens": 10, "remote_token_hash": token_hash(list(range(10)))}


def test_remote_params_parse_flat_and_grouped_block_ids():
    prompt = list(range(10))
    remote, n = parse_remote(GOOD, prompt, 4)
    assert remote.block_ids == (4, 5, 6) and n == 10 and remote.incarnation == 3
    remote, _ = parse_remote({**GOOD, "remote_block_ids": [[4, 5, 6]]}, prompt, 4)
    assert remote.block_ids == (4, 5, 6)


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [4, 5]}, {"remote_block_ids": [4, -5, 6]}, {"remote_block_ids": "4,5,6"},
    {"remote_block_ids": [[4], [5, 6]]}, {"remote_port": 0}, {"remote_port": True}, {"remote_host": None},
    {"remote_lease_epoch": -1}, {"tp_size": 2}, {"remote_num_tokens": 11}, {"remote_num_tokens": 0},
    {"prompt_token_ids": [0] * 10}, {"remote_token_hash": None}, {"remote_token_hash": token_hash([0] * 10)},
])
def test_remote_params_reject_untrusted_garbage(change):
    with pytest.raises(BadTransferParams):
        parse_remote({**GOOD, **change}, list(range(10)), 4)


def test_transfer_log_line_and_metrics():
    now = [0.0]
    log = TransferLog(interval_s=10, clock=lambda: now[0])
    log.record(2_000_000, 1, 0.002)
    log.record(4_000_000, 3, 0.004)
    log.record_failure("timeout")
    assert log.maybe_log() is None  # not yet: one line per interval
    now[0] = 11
    line = log.maybe_log()
    assert line.startswith("KV transfer: 2 reads, 1 failed, 6.0 MB, 4 descriptors")
    assert "1.00 GB/s" in line
    now[0] = 22
    assert log.maybe_log() is None  # quiet intervals print nothing
    text = log.metrics.render().decode()
    assert "vllm:nixl_xfer_time_seconds_count 2.0" in text
    assert 'vllm:nixl_num_failed_transfers_total{reason="timeout"} 1.0' in text


def test_serve_refuses_a_bad_kv_transfer_config_with_one_line():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "token_engine.cli", "serve", "/nonexistent-model", "--kv-transfer-config",
         '{"kv_connector": "NixlConnector", "kv_load_failure_policy": "maybe"}'],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "kv_load_failure_policy" in out.stderr and "Traceback" not in out.stderr
