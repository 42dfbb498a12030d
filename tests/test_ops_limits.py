"""Request limits over real HTTP: every bound a client can hit is a 4xx with the OpenAI-style error body,
and nothing a client sends is unpickled or evaluated."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

import render_service.http.server
import token_engine.http.server
from splitserve_common import limits
from tests.engine_harness import ServerThread, engine_config, write_tiny_qwen3
from tests.render_harness import RenderServer, qwen3_config

MODEL = "qwen3-0.6b"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def render():
    with RenderServer(qwen3_config(parsers=True, max_model_len=64)) as server:
        yield server


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = write_tiny_qwen3(tmp_path_factory.mktemp("ops-limits") / "tiny")
    with ServerThread(engine_config(model)) as server:
        yield server


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param
    return error


def test_oversized_bodies_are_413_declared_or_streamed(render, engine, monkeypatch):
    monkeypatch.setattr(render_service.http.request_io, "MAX_BODY_BYTES", 4096)
    monkeypatch.setattr(token_engine.http.server, "MAX_REQUEST_BYTES", 4096)
    big = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"x" * 8000)
    for url in (render.url + "/v1/completions/render", engine.url + "/inference/v1/generate"):
        declared = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30)
        assert_error(declared, 413)
        chunked = httpx.post(url, content=iter([big[:3000], big[3000:]]),
                             headers={"content-type": "application/json"}, timeout=30)
        assert_error(chunked, 413)


def test_too_many_messages_tools_or_prompts_are_400(render):
    messages = [{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1)
    r = render.client.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
    assert_error(r, 400, "messages")
    r = render.client.post("/v1/chat/completions/render", json={
        "model": MODEL, "messages": messages[:1], "tools": [TOOL] * (limits.MAX_TOOLS + 1)})
    assert_error(r, 400, "tools")
    r = render.client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert_error(r, 400, "messages")
    r = render.client.post("/v1/completions/render", json={"model": MODEL, "prompt": ["a"] * (limits.MAX_PROMPTS + 1)})
    assert_error(r, 400, "prompt")
    # At the bounds, still served.
    r = render.client.post("/v1/chat/completions/render", json={
        "model": MODEL, "messages": messages[:1], "tools": [TOOL] * limits.MAX_TOOLS})
    assert r.status_code != 400 or r.json()["error"]["param"] != "tools"


def test_token_counts_beyond_the_context_window_are_400(render, engine):
    r = render.client.post("/v1/completions/render", json={"model": MODEL, "prompt": "word " * 200})
    assert "maximum context length" in assert_error(r, 400)["message"]
    r = render.client.post("/v1/completions/render", json={"model": MODEL, "prompt": "hi", "max_tokens": 10_000})
    assert_error(r, 400)
    with engine.client() as http:
        r = http.post("/inference/v1/generate", json={"token_ids": [1] * 500, "sampling_params": {"max_tokens": 1}})
        assert_error(r, 400, "token_ids")


BAD_KV_PARAMS = [
    ["not", "an", "object"],
    {"nested": {"object": 1}},
    {"remote_block_ids": [[1, [2]]]},
    {"remote_host": "h" * (limits.MAX_KV_PARAMS_STRING_CHARS + 1)},
    {f"k{i}": i for i in range(limits.MAX_KV_PARAMS_KEYS + 1)},
    {"k" * (limits.MAX_KV_PARAMS_KEY_CHARS + 1): 1},
]


@pytest.mark.parametrize("params", BAD_KV_PARAMS, ids=range(len(BAD_KV_PARAMS)))
def test_kv_transfer_params_of_the_wrong_shape_are_400_on_render_and_engine(render, engine, params):
    r = render.client.post("/v1/completions/render", json={"model": MODEL, "prompt": "hi", "kv_transfer_params": params})
    assert_error(r, 400)
    with engine.client() as http:
        r = http.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 1},
                                                      "kv_transfer_params": params})
        assert_error(r, 400)


def test_nixl_shaped_kv_transfer_params_pass_the_shape_check(render):
    params = {"do_remote_decode": True, "remote_block_ids": [[0, 1, 2]], "remote_engine_id": "e", "remote_host": None,
              "remote_port": 5600, "tp_size": 1, "prompt_token_ids": [1, 2, 3]}
    r = render.client.post("/v1/completions/render", json={"model": MODEL, "prompt": "hi", "kv_transfer_params": params})
    assert r.status_code == 200, r.text


def derender_stream(render, state) -> httpx.Response:
    return render.client.post("/v1/chat/completions/derender", json={
        "stream": True, "stream_state": state, "prompt_token_ids": [151644, 77091, 198],
        "generate_chunk": {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": [9707]}]},
        "chat_request": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}})


@pytest.mark.parametrize("state", [
    "x" * 70_000,  # over the size cap
    {"splitserve_state": "ss1." + "A" * 70_000},
    {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
    {"splitserve_state": 12},
    {"splitserve_state": "ss1.not-base64!"},
    [1, 2, 3],
])
def test_stream_state_too_large_or_of_the_wrong_shape_is_400(render, state):
    first = derender_stream(render, None)
    assert first.status_code == 200, first.text
    r = derender_stream(render, state)
    assert_error(r, 400)


FORBIDDEN_CALLS = {("pickle", "loads"), ("pickle", "load"), ("marshal", "loads"), ("yaml", "load"),
                   ("dill", "loads"), ("cloudpickle", "loads"), ("torch", "load")}


def test_no_code_path_unpickles_or_evaluates_input():
    """AST scan of both servers' packages: no eval/exec/compile, no pickle-style loaders."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for package in ("render_service", "token_engine"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                if isinstance(f, ast.Name) and f.id in ("eval", "exec", "compile", "__import__"):
                    found.append(f"{path.name}:{node.lineno} {f.id}")
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                        (f.value.id, f.attr) in FORBIDDEN_CALLS:
                    found.append(f"{path.name}:{node.lineno} {f.value.id}.{f.attr}")
                if isinstance(f, ast.Name) and f.id == "import_module":
                    found.append(f"{path.name}:{node.lineno} import_module")
    assert found == []
