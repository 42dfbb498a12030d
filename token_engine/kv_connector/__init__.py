"""KV connectors: the seam (base.py) and the NIXL prefill/decode handoff behind it."""
