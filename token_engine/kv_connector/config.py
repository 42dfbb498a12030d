"""`--kv-transfer-config` for the NixlConnector, read as vLLM reads it (reference/vllm-renderer-api.md §9.1).

Top level: kv_connector, kv_role (kv_producer | kv_consumer | kv_both; like vLLM, the role does not restrict
what an engine does: the caller decides who prefills), kv_load_failure_policy (fail | recompute; also
accepted inside kv_connector_extra_config as issue 5 words it), engine_id, kv_buffer_device.
kv_connector_extra_config: kv_lease_duration (s), bidirectional_kv_xfer, decoder_kv_blocks_ttl (s, how long
decode holds a finished turn's blocks for the next turn's prefill), backends (["UCX"] only), plus ours:
kv_load_timeout (s, our own deadline for a whole load), kv_log_interval (s).
Side channel: VLLM_NIXL_SIDE_CHANNEL_HOST (default localhost) and VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600;
0 picks a free port, which then travels in kv_transfer_params as remote_port).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class NixlConnectorConfig:
    engine_id: str
    kv_role: str = "kv_both"
    load_failure_policy: str = "fail"
    lease_duration_s: float = 30.0
    load_timeout_s: float = 10.0
    log_interval_s: float = 10.0
    bidirectional: bool = False
    decoder_ttl_s: float = 480.0
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600


def _number(extra: dict, key: str, default: float, low: float, high: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise ValueError(f"kv_connector_extra_config.{key} must be a number in ({low}, {high}], got {value!r}")
    return float(value)


def parse_nixl_config(cfg: dict, env: dict | None = None) -> NixlConnectorConfig:
    """Validate the JSON; every error is a ValueError naming the key, so the CLI can print it and exit."""
    env = os.environ if env is None else env
    if cfg.get("kv_connector") != "NixlConnector":
        raise ValueError(f"kv_connector must be 'NixlConnector', got {cfg.get('kv_connector')!r}")
    role = cfg.get("kv_role", "kv_both")
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {ROLES}, got {role!r}")
    extra = cfg.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    policy = cfg.get("kv_load_failure_policy", extra.get("kv_load_failure_policy", "fail"))
    if policy not in POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {POLICIES}, got {policy!r}")
    backends = extra.get("backends", ["UCX"])
    if backends != ["UCX"]:
        raise ValueError(f"kv_connector_extra_config.backends: only ['UCX'] is supported here, got {backends!r}")
    device = cfg.get("kv_buffer_device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"kv_buffer_device must be 'cuda' or 'cpu', got {device!r}")
    bidirectional = extra.get("bidirectional_kv_xfer", False)
    if not isinstance(bidirectional, bool):
        raise ValueError("kv_connector_extra_config.bidirectional_kv_xfer must be true or false")
    engine_id = cfg.get("engine_id") or f"engine-{uuid.uuid4().hex[:12]}"
    if not isinstance(engine_id, str) or len(engine_id) > 128:
        raise ValueError("engine_id must be a string of at most 128 characters")
    port_text = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    try:
        port = int(port_text)
        if not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT must be a port number, got {port_text!r}") from None
    return NixlConnectorConfig(
        engine_id=engine_id, kv_role=role, load_failure_policy=policy,
        lease_duration_s=_number(extra, "kv_lease_duration", 30.0, 0, 86400),
        load_timeout_s=_number(extra, "kv_load_timeout", 10.0, 0, 3600),
        log_interval_s=_number(extra, "kv_log_interval", 10.0, 0, 86400),
        bidirectional=bidirectional,
        decoder_ttl_s=_number(extra, "decoder_kv_blocks_ttl", 480.0, 0, 86400),
        side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_channel_port=port)
