"""Operator tools for the KV path, apart from the connector: `token-engine preflight` and the loopback peer it,
tests and benches drive."""
