"""`--kv-transfer-config` for the NixlConnector (pull) and NixlPushConnector (push), read as vLLM reads it
(reference/vllm-renderer-api.md §9.1).

Top level: kv_connector, kv_role (kv_producer | kv_consumer | kv_both; like vLLM, the role does not restrict
what an engine does: the caller decides who prefills), kv_load_failure_policy (fail | recompute; also
accepted inside kv_connector_extra_config as the P/D design words it), engine_id, kv_buffer_device.
kv_connector_extra_config: kv_lease_duration (s), bidirectional_kv_xfer, decoder_kv_blocks_ttl (s, how long
decode holds a finished turn's blocks for the next turn's prefill), backends (["UCX"] only), plus ours:
kv_load_timeout (s, our own deadline for a whole load), kv_log_interval (s).
Side channel: VLLM_NIXL_SIDE_CHANNEL_HOST (default localhost) and VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600;
0 picks a free port, which then travels in kv_transfer_params as remote_port).
Trust (docs/security.md, "KV handoff"): kv_side_channel_secret (else SPLITSERVE_KV_SECRET; the CLI's
--kv-side-channel-secret), the shared secret of the side channel's HMAC handshake; kv_allowed_peers (else
SPLITSERVE_KV_ALLOWED_PEERS; --kv-allowed-peers), the hosts/CIDRs decode may contact, default loopback only;
kv_lease_budget_fraction (default 0.25), the share of prefill's KV blocks one caller may hold under leases.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from token_engine.kv_connector.peers import DEFAULT_ALLOWED_PEERS, AllowedPeers

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = {"NixlConnector": "pull", "NixlPushConnector": "push"}  # as upstream: NixlConnector pulls
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
    side_channel_secret: bytes | None = field(default=None, repr=False)
    allowed_peers: tuple[str, ...] = DEFAULT_ALLOWED_PEERS
    lease_budget_fraction: float = 0.25
    mode: str = "pull"  # "push" for NixlPushConnector


def _number(extra: dict, key: str, default: float, low: float, high: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:
        raise ValueError(f"kv_connector_extra_config.{key} must be a number in ({low}, {high}], got {value!r}")
    return float(value)


def parse_nixl_config(cfg: dict, env: Mapping[str, str] | None = None) -> NixlConnectorConfig:
    """Validate the JSON; every error is a ValueError naming the key, so the CLI can print it and exit."""
    env = os.environ if env is None else env
    if cfg.get("kv_connector") not in CONNECTORS:
        raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {cfg.get('kv_connector')!r}")
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
    secret = extra.get("kv_side_channel_secret", env.get("SPLITSERVE_KV_SECRET") or None)
    if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
        raise ValueError("the KV side-channel secret (kv_side_channel_secret / SPLITSERVE_KV_SECRET) must be a "
                         "string of at least 16 characters")
    peers = extra.get("kv_allowed_peers", env.get("SPLITSERVE_KV_ALLOWED_PEERS") or None)
    if peers is not None and not (isinstance(peers, str) or (
            isinstance(peers, list) and all(isinstance(p, str) for p in peers))):
        raise ValueError("kv_connector_extra_config.kv_allowed_peers must be a list of hosts/CIDRs or a "
                         "comma-separated string")
    entries = DEFAULT_ALLOWED_PEERS if peers is None else tuple(
        e.strip() for e in (peers.split(",") if isinstance(peers, str) else peers) if e.strip())
    AllowedPeers(entries)  # a bad entry is a ValueError naming it
    return NixlConnectorConfig(
        engine_id=engine_id, kv_role=role, load_failure_policy=policy,
        lease_duration_s=_number(extra, "kv_lease_duration", 30.0, 0, 86400),
        load_timeout_s=_number(extra, "kv_load_timeout", 10.0, 0, 3600),
        log_interval_s=_number(extra, "kv_log_interval", 10.0, 0, 86400),
        bidirectional=bidirectional,
        decoder_ttl_s=_number(extra, "decoder_kv_blocks_ttl", 480.0, 0, 86400),
        side_channel_host=env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_channel_port=port,
        side_channel_secret=secret.encode() if secret else None,
        allowed_peers=entries,
        lease_budget_fraction=_number(extra, "kv_lease_budget_fraction", 0.25, 0, 1),
        mode=CONNECTORS[cfg["kv_connector"]])
