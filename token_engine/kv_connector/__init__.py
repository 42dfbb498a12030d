"""KV connectors: the seam (base.py) and the NIXL prefill/decode handoff behind it.

- base.py: the seam the scheduler and engine loop call (owned by the engine).
- nixl.py: NixlConnector, the seam implemented with the pieces below (vLLM's kv_transfer_params).
- config.py: `--kv-transfer-config` as vLLM reads it.
- handoff.py: KVHandoff, one engine's handoff: both halves below over one NIXL agent and one lock, advanced
  by poll() and a small poller thread.
- handoff_producer.py: the prefill half: leases, the side channel, decode's notifications, pushes.
- handoff_consumer.py: the decode half: loads (pull: claim, lease pin, READ; push: a reservation the producer
  WRITEs into), their kinds and phases, peers and links cached.
- handoff_types.py: what both halves share: RemoteKV (decode's claim), LoadOutcome, HandoffPoll.
- nixl_transport.py: one NIXL agent (UCX, no progress thread), READs with our own deadlines, one error path.
- descriptors.py: pool geometry; consecutive block runs merged into single descriptors.
- side_channel.py: length-prefixed msgspec JSON over TCP (kept-open links): agent metadata, pool address,
  geometry, model fingerprint, lease claim and pin; HMAC handshake with a shared secret; bounded connections.
- fingerprint.py: model weights + KV config fingerprint; engines that differ refuse each other's KV.
- leases.py: prefill leases keyed by (request id, epoch), each with the block ids and token hash it vouches
  for (`claim_mismatch`: the one place a reader's claim is checked); notification formats.
- peers.py: the allowlist of producer peers decode may contact (SSRF guard), default loopback.
- metrics.py: Prometheus metrics (vLLM's nixl names) and the periodic "KV transfer" log line.
- kv_tools/preflight.py: `token-engine preflight`; kv_tools/loopback_peer.py: a prefill-like peer process for it, tests,
  bench.
"""
