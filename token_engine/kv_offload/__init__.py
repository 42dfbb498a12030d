"""KV offload: a bounded host-memory tier below the device pool.

`config` reads vLLM's ways of asking for it (``--kv-offloading-size`` with ``--kv-offloading-backend native``, or
``OffloadingConnector`` in ``--kv-transfer-config``); `host_tier` keeps evicted full blocks, LRU, keyed by block
hash and guarded by a fingerprint of the weights and KV layout, and loads them back for a prefix hit while the
request waits out of the steps (as for a NIXL pull) until the copies finished.
"""
