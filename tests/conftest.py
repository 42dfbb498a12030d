"""Fixtures every test module may use: the real vLLM peers (started once per session, skipped where absent)."""

pytest_plugins = ("tests.vllm_peers",)
