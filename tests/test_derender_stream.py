"""Streaming derender over real HTTP: vLLM's recorded streams, batch == stream, errors, n>1, signing."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.shared_paths import SHARED as SHARED_DIR

SHARED = SHARED_DIR

QWEN = str(SHARED / "fixtures/qwen3-0.6b")
FIXTURES = str(SHARED / "fixtures/vllm-0.32-render")
PARSER_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def render_server(*flags: str, env: dict[str, str] | None = None):
    """A real render server process on a random loopback port; always stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "render_service.cli", "serve", QWEN, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "qwen3-0.6b", "--log-level", "warning", *flags]
    proc_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, env=proc_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # bounded wait for startup (tokenizer load)
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("server did not start")
        with httpx.Client(base_url=base, timeout=30.0) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def parsers_server():
    with render_server(*PARSER_FLAGS) as client:
        yield client


@pytest.fixture(scope="module")
def plain_server():
    with render_server() as client:
        yield client


def recorded(kind: str, name: str) -> list[tuple[dict, dict]]:
    steps = []
    for f in sorted(glob.glob(f"{FIXTURES}/{kind}/{name}/step_*.request.json")):
        steps.append((json.load(open(f))["body"], json.load(open(f.replace("request", "response")))))
    return steps


def set_fields(delta: dict) -> dict:
    return {k: v for k, v in delta.items() if v is not None}


def strip_ids(delta: dict) -> dict:
    out = set_fields(json.loads(json.dumps(delta)))
    for tc in out.get("tool_calls", []):
        tc.pop("id", None)
        for k in [k for k, v in tc.items() if v is None]:
            del tc[k]
        tc["function"] = set_fields(tc.get("function") or {})
        if "type" in tc:
            tc["type"] = "function"
    return out


def run_stream(client: httpx.Client, steps: list[dict], path: str = "/v1/chat/completions/derender"):
    """Send recorded request bodies, echoing our own stream_state; return (answers, state sizes)."""
    state, answers, sizes = None, [], []
    for body in steps:
        body = dict(body, stream_state=state)
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        state = out["stream_state"]
        sizes.append(len(json.dumps(state)))
        answers.append(out["chunk"])
    return answers, sizes


def test_parser_stream_matches_vllm_recording_except_tool_call_ids(parsers_server):
    steps = recorded("parsers", "12_chat_derender_stream")
    answers, sizes = run_stream(parsers_server, [b for b, _ in steps])
    ids = set()
    ours_args, their_args = "", ""
    for ours, (_, theirs) in zip(answers, steps):
        want = theirs["body"]["chunk"]
        mine, their = strip_ids(ours["choices"][0]["delta"]), strip_ids(want["choices"][0]["delta"])
        # arguments: vLLM streams a member's key as it comes; the guard holds a member's head (key, colon) until
        # its value begins (docs/tool_parsers.md), so ours may lag by that head, never lead, and the totals agree
        ours_args += "".join(tc["function"].pop("arguments", "") for tc in mine.get("tool_calls", []))
        their_args += "".join(tc["function"].pop("arguments", "") for tc in their.get("tool_calls", []))
        assert their_args.startswith(ours_args) and len(their_args) - len(ours_args) <= len(', "city": ')
        for delta in (mine, their):
            delta["tool_calls"] = [tc for tc in delta.get("tool_calls", []) if tc["function"] or len(tc) > 2]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        assert mine == their
        assert ours["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert ours["id"] == want["id"]
        for tc in ours["choices"][0]["delta"].get("tool_calls") or []:
            if tc.get("id"):
                ids.add(tc["id"])
    assert ours_args == their_args
    assert answers[-1]["usage"]["total_tokens"] == steps[-1][1]["body"]["chunk"]["usage"]["total_tokens"]
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-tool-")
    # no history in the state: constant while reasoning/content streams, bounded inside a call
    assert len(set(sizes[1:9])) == 1
    assert max(sizes) < 1024


def test_plain_chat_and_completion_streams_match_vllm(plain_server):
    for name, path in (("12_chat_derender_stream", "/v1/chat/completions/derender"),
                       ("14_completions_derender_stream", "/v1/completions/derender")):
        steps = recorded("noparsers", name)
        answers, _ = run_stream(plain_server, [b for b, _ in steps], path)
        for ours, (_, theirs) in zip(answers, steps):
            want = theirs["body"]["chunk"]
            if not want["choices"]:
                assert ours["choices"] == []
                continue
            if "delta" in want["choices"][0]:
                assert set_fields(ours["choices"][0]["delta"]) == set_fields(want["choices"][0]["delta"])
            else:
                assert ours["choices"][0]["text"] == want["choices"][0]["text"]
            assert ours["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]


def test_batch_derender_equals_concatenated_stream(parsers_server):
    batch_req = json.load(open(f"{FIXTURES}/parsers/09_chat_derender_batch_tools.request.json"))["body"]
    ids = batch_req["generate_response"]["choices"][0]["token_ids"]
    rid = batch_req["generate_response"]["request_id"]
    batch = parsers_server.post("/v1/chat/completions/derender", json=batch_req).json()["choices"][0]
    steps = [{"stream": True, "model": "qwen3-0.6b", "chat_request": batch_req["chat_request"],
              "generate_chunk": {"request_id": rid, "choices": [
                  {"index": 0, "token_ids": ids[i:i + 3], "finish_reason": "stop" if i + 3 >= len(ids) else None}]}}
             for i in range(0, len(ids), 3)]
    answers, _ = run_stream(parsers_server, steps)
    content = "".join(a["choices"][0]["delta"].get("content") or "" for a in answers)
    reasoning = "".join(a["choices"][0]["delta"].get("reasoning") or "" for a in answers)
    calls = [tc for a in answers for tc in a["choices"][0]["delta"].get("tool_calls") or []]
    msg = batch["message"]
    assert content == msg["content"] and reasoning == msg["reasoning"]
    assert calls[0]["id"] == msg["tool_calls"][0]["id"]
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == msg["tool_calls"][0]["function"]["arguments"]
    assert answers[-1]["choices"][0]["finish_reason"] == batch["finish_reason"] == "tool_calls"


def test_retried_chunk_gets_the_same_answer_and_tool_call_id(parsers_server):
    steps = [b for b, _ in recorded("parsers", "12_chat_derender_stream")]
    state = None
    for body in steps[:17]:
        state = parsers_server.post("/v1/chat/completions/derender", json=dict(body, stream_state=state)).json()["stream_state"]
    first = parsers_server.post("/v1/chat/completions/derender", json=dict(steps[17], stream_state=state)).json()
    again = parsers_server.post("/v1/chat/completions/derender", json=dict(steps[17], stream_state=state)).json()
    assert first["chunk"]["choices"] == again["chunk"]["choices"]
    assert first["chunk"]["choices"][0]["delta"]["tool_calls"][0]["id"]


def test_n2_choices_stream_independently(parsers_server):
    body = recorded("parsers", "12_chat_derender_stream")[0][0]
    tok_steps = [[151667], [198], [23657], [151668], [9707]]
    states = {0: None, 1: None}
    text = {0: "", 1: ""}
    for step in tok_steps:
        for index in (0, 1):
            b = dict(body, stream_state=states[index], generate_chunk={
                "request_id": "gen-n2", "choices": [{"index": index, "token_ids": step, "finish_reason": None}]})
            out = parsers_server.post("/v1/chat/completions/derender", json=b).json()
            choice = out["chunk"]["choices"][0]
            assert choice["index"] == index
            if step == tok_steps[0]:
                assert choice["delta"]["role"] == "assistant"
            states[index] = out["stream_state"]
            text[index] += choice["delta"].get("reasoning") or ""
    assert text[0] == text[1] == "\nNeed"


@pytest.mark.parametrize("mutate, param", [
    (lambda b: b.pop("chat_request"), "chat_request"),
    (lambda b: b["generate_chunk"]["choices"].append(dict(b["generate_chunk"]["choices"][0], index=1)), "generate_chunk"),
    (lambda b: b["generate_chunk"]["choices"][0].update(token_ids=[10**7]), "generate_chunk"),
    (lambda b: b.update(stream_state={"splitserve_state": "ss1.garbage"}), "stream_state"),
    (lambda b: b.update(stream_state="x" * 100), "stream_state"),
])
def test_bad_requests_are_400_with_openai_error_body(parsers_server, mutate, param):
    body = json.loads(json.dumps(recorded("parsers", "12_chat_derender_stream")[1][0]))
    mutate(body)
    r = parsers_server.post("/v1/chat/completions/derender", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param


def test_usage_only_chunk_passes_state_through(parsers_server):
    body = recorded("parsers", "12_chat_derender_stream")[0][0]
    b = dict(body, stream_state={"splitserve_state": "opaque"}, prompt_tokens=7,
             generate_chunk={"request_id": "g", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
    out = parsers_server.post("/v1/chat/completions/derender", json=b).json()
    assert out["chunk"]["choices"] == []
    assert out["chunk"]["usage"]["prompt_tokens"] == 7 and out["chunk"]["usage"]["total_tokens"] == 10
    assert out["stream_state"] == {"splitserve_state": "opaque"}


def test_signed_tier_refuses_state_from_an_unsigned_or_differently_keyed_server(parsers_server):
    body = recorded("parsers", "12_chat_derender_stream")[0][0]
    unsigned = parsers_server.post("/v1/chat/completions/derender", json=body).json()["stream_state"]
    with render_server(*PARSER_FLAGS, env={"SPLITSERVE_STREAM_STATE_SECRET": "s3cret"}) as signed:
        r = signed.post("/v1/chat/completions/derender", json=dict(body, stream_state=unsigned))
        assert r.status_code == 400 and "signed" in r.json()["error"]["message"]
        ok = signed.post("/v1/chat/completions/derender", json=body).json()["stream_state"]
        r2 = signed.post("/v1/chat/completions/derender", json=dict(recorded("parsers", "12_chat_derender_stream")[1][0], stream_state=ok))
        assert r2.status_code == 200


def test_logprobs_repair_a_character_split_across_chunks_with_the_carried_context():
    """In-process: the byte tokens of one emoji arrive in separate chunks; the completing token's logprob
    carries the character (the sampled ids of earlier chunks travel in stream_state)."""
    import msgspec

    from render_service.derender.stream import StreamRuntime, derender_completion_stream
    from render_service.render.render_config import load_render_config
    from render_service.tokenize.byte_level import BYTE_TO_CHAR
    from render_service.wire.protocol import DerenderCompletionStreamRequest

    cfg = load_render_config(QWEN, served_model_names=["m"])
    table = BYTE_TO_CHAR
    ids = cfg.tokenizer.encode("a") + [cfg.tokenizer.token_to_id(table[b]) for b in "😀".encode()]
    rt, state, tokens, offsets, texts = StreamRuntime(), None, [], [], []
    for t in ids:
        body = {"stream": True, "stream_state": state, "generate_chunk": {"request_id": "g", "choices": [
            {"index": 0, "token_ids": [t], "finish_reason": None,
             "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "top_logprobs": []}]}}]}}
        out = msgspec.to_builtins(derender_completion_stream(
            msgspec.convert(body, DerenderCompletionStreamRequest), cfg, rt))
        state = out["stream_state"]
        choice = out["chunk"]["choices"][0]
        texts.append(choice["text"])
        tokens += choice["logprobs"]["tokens"]
        offsets += choice["logprobs"]["text_offset"]
    assert texts == ["a", "", "", "", "😀"]
    assert "".join(tokens) == "a😀" and "\ufffd" not in "".join(tokens)
    assert offsets[0] == 0 and offsets[-1] == 1


def test_plain_path_continues_from_vllm_recorded_state_mid_stream():
    """In-process, no parsers: vLLM's own prev_tokens/offsets window is adopted and the rest of the stream
    matches vLLM's recording; the answer keeps vLLM's window fields current for a vLLM client."""
    import msgspec

    from render_service.derender.stream import StreamRuntime, derender_chat_stream
    from render_service.render.render_config import load_render_config
    from render_service.wire.protocol import DerenderChatStreamRequest

    cfg = load_render_config(QWEN, served_model_names=["qwen3-0.6b"])
    steps = recorded("noparsers", "12_chat_derender_stream")
    k = 3
    state = steps[k][1]["body"]["stream_state"]
    assert "prev_tokens" in state and "splitserve_state" not in state
    rt = StreamRuntime()
    for body, (_, resp) in zip([b for b, _ in steps[k + 1:]], steps[k + 1:]):
        out = msgspec.to_builtins(derender_chat_stream(
            msgspec.convert(dict(body, stream_state=state), DerenderChatStreamRequest), cfg, rt))
        want = resp["body"]["chunk"]["choices"][0]
        assert set_fields(out["chunk"]["choices"][0]["delta"]) == set_fields(want["delta"])
        state = out["stream_state"]
        assert {"prev_tokens", "prefix_offset", "read_offset", "role_sent"} <= set(state)
