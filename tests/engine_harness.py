"""Shared pieces of the token-engine tests: a tiny random Qwen3 model, a real uvicorn server on a loopback
port in a thread, a plain greedy loop over the model to compare against, and block-accounting waits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
import uvicorn

from tests.shared_paths import FIXTURES as FIXTURES_DIR
from token_engine.core.engine import AsyncEngine, EngineConfig, LLMEngine
from token_engine.http.server import build_app
from token_engine.kv_offload.host_tier import HostKVTier, HostLoad
from token_engine.layers.attention import allocate_kv_pool, build_metadata
from token_engine.models.random_model import write_random_model

FIXTURES = FIXTURES_DIR
if not FIXTURES.exists():  # a clean checkout carries its own copy
    FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"

# Untied lm_head: tied embeddings make a random model echo its last input token forever, which would let
# chunked/unchunked or preempted/unpreempted comparisons pass trivially.
TINY_QWEN3 = {"tie_word_embeddings": False}


def write_tiny_qwen3(out_dir, vocab_size: int | None = None) -> Path:
    overrides = dict(TINY_QWEN3)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return write_random_model(out_dir, arch="qwen3", preset="tiny", overrides=overrides, dtype="float32")


LoadedModel = tuple[Path, torch.nn.Module]


def tiny_loaded_model(tmp_path_factory) -> Iterator[LoadedModel]:
    """A module fixture's body: a tiny random Qwen3 written once and loaded once (one torch thread while the
    module runs, so engines in one test process do not fight over the cores)."""
    from token_engine.models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_dir = write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), vocab_size=2048)
    yield model_dir, load_model(model_dir, dtype="float32")
    torch.set_num_threads(threads)


def make_engine(model: LoadedModel, **kw) -> LLMEngine:
    """An engine over a ``tiny_loaded_model`` (its weights shared, not reloaded)."""
    model_dir, loaded = model
    return LLMEngine(engine_config(model_dir, **kw), model=loaded)


def engine_config(model_dir, **kw) -> EngineConfig:
    defaults = dict(model=str(model_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
                    block_size=4, max_num_batched_tokens=64, max_num_seqs=16, seed=0)
    defaults.update(kw)
    return EngineConfig(**defaults)


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with a full recompute of the whole sequence per token: no paging tricks, no cache reuse."""
    arch = model.arch
    tokens = list(prompt)
    for _ in range(num_tokens):
        n = len(tokens)
        block_size = 16
        blocks = -(-n // block_size)
        pool = allocate_kv_pool(blocks, arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, arch.dtype)
        meta = build_metadata([n], [n], [list(range(blocks))], block_size)
        hidden = model.forward(torch.tensor(tokens), torch.arange(n), meta, pool)
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt):]


class ServerThread:
    """A real HTTP server (uvicorn) on 127.0.0.1:<random port>, serving a real engine thread."""

    def __init__(self, config: EngineConfig, connector=None, **app_kw):
        self.llm = LLMEngine(config, connector=connector)
        self.engine = AsyncEngine(self.llm)
        self.app = build_app(self.engine, config.model_name, config.model, **app_kw)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.engine.start()
        self.thread.start()
        for _ in range(400):  # bounded wait for the listener
            if self.server.started:
                break
            time.sleep(0.025)
        assert self.server.started, "server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
        self.sock.close()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)


@contextmanager
def single_threaded_server(config: EngineConfig, **app_kw) -> Iterator[ServerThread]:
    """A ServerThread with torch on one thread: tiny matmuls, where thread hand-offs cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ServerThread(config, **app_kw) as srv:
            yield srv
    finally:
        torch.set_num_threads(threads)


def idle_client(server: ServerThread) -> Iterator[httpx.Client]:
    """A client for one test, which must leave the block pool as it found it."""
    with server.client() as c:
        yield c
    assert wait_for_idle_blocks(server.llm) == server.llm.num_blocks


def wait_for_idle_blocks(llm: LLMEngine, attempts: int = 400) -> int:
    """Waits (bounded) until no request holds a block; returns the free count for the caller to assert on."""
    for _ in range(attempts):
        if llm.num_free_blocks() == llm.num_blocks and not llm.requests:
            break
        time.sleep(0.025)
    return llm.num_free_blocks()


STEP_HANG_GUARD_S = 600.0  # only stops a broken test from hanging; a busy machine never comes near it


def step_until(engines, until, max_steps: int | None = None) -> None:
    """Steps the engines in turn until ``until()`` holds. What it waits for may hang on another thread (a NIXL
    notification, a lease ending), so by default no step count bounds it, only a hang guard in wall time;
    ``max_steps`` bounds the steps where the state depends on the engines' own steps alone."""
    deadline = time.monotonic() + STEP_HANG_GUARD_S
    steps = 0
    while max_steps is None or steps < max_steps:
        for e in engines:
            e.step()
        steps += 1
        if until():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.0002)
    raise AssertionError(f"engines never reached the expected state ({steps} steps)")


def finish_request(engine: LLMEngine, others, rid: str, prompt: list[int], options, params):
    """Runs one request on ``engine`` (stepping ``others`` too) to its end: (output tokens, final update)."""
    tokens, done = [], {}

    def on_update(u):
        tokens.extend(t for delta in u.deltas for t in delta.token_ids)
        if u.finished:
            done["u"] = u

    engine.add_request(rid, prompt, options, kv_transfer_params=params, on_update=on_update)
    step_until([engine, *others], lambda: "u" in done)
    return tokens, done["u"]


class HeldLoads(HostKVTier):
    """The host KV tier with real copies (plain, on CPU) whose loads report finished only once ``held`` is off: how
    a load still under way on a GPU's copy engine looks to the scheduler, driven step by step."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.held = False

    def _copied(self, load: HostLoad) -> bool:
        return not self.held and super()._copied(load)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The device of engine processes: cpu (CI); SPLITSERVE_TEST_DEVICE=cuda runs the same P/D tests with both
# engines on one GPU (NIXL moving VRAM), as the GPU machine checks them.
TEST_DEVICE = os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu")


class EngineProcess:
    """`token-engine serve` as its own process on 127.0.0.1 (a P/D prefill engine: NIXL between processes),
    small enough for CI: 128-token context, 4-token blocks, `blocks` KV blocks."""

    def __init__(self, model_dir, kv_transfer_config: dict, side_channel_port: int | None = None,
                 env: dict | None = None, blocks: int = 64):
        """side_channel_port None: a free one. A port picked free here can be taken by another socket (a client's
        own end of a connection, say) before the engine binds it; the engine then exits saying so, and it is
        started again on other ports. A side channel port the caller chose is never changed."""
        for attempt in range(3):
            side = side_channel_port or free_port()
            self.port = free_port()
            while self.port == side:
                self.port = free_port()
            error = self._start(model_dir, kv_transfer_config, side, env, blocks)
            if error is None:
                return
            taken = "already in use" in error.lower()
            if not taken or attempt == 2 or (side_channel_port is not None and "side channel" in error):
                raise AssertionError(error)

    def _start(self, model_dir, kv_transfer_config: dict, side_channel_port: int, env: dict | None,
               blocks: int) -> str | None:
        """Starts the process and waits for its health check: None once healthy, else what it printed as it died."""
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port), "OMP_NUM_THREADS": "1",
               **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "token_engine.cli", "serve", str(model_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--device", TEST_DEVICE, "--dtype", "float32", "--max-model-len", "128",
             "--block-size", "4",
             "--num-gpu-blocks-override", str(blocks), "--log-level", "warning",
             "--kv-transfer-config", json.dumps(kv_transfer_config)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        deadline = time.monotonic() + 180  # hang guard only: a loaded 2-core box needs ~15 s
        while True:
            if self.proc.poll() is not None:
                self.client.close()
                error = self.proc.stderr.read().decode(errors="replace")[-3000:]
                self.proc.stderr.close()
                return error
            try:
                if self.client.get("/health").status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine process did not come up"
            time.sleep(0.1)

    def kill(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stderr.close()
