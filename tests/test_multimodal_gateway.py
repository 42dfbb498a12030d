"""Images through the gateway's routes (chat, Messages, Responses) and Messages' count_tokens, over real processes
on loopback: a gateway serving a Qwen2.5-VL-shaped bundle (the real Qwen3 tokenizer, Qwen2.5-VL's template and
processor settings) renders image requests as its own /render endpoints do and sends the engine the expanded ids
with ``features``; our token engine, which serves text models, refuses them and the client gets that 400 in its
API's error shape, streamed or not; a gateway over a text model refuses images with a 400 naming the families
covered. To see what reaches an engine that takes features, a recording engine (a real HTTP server on
127.0.0.1) keeps each generate body and answers a token stream."""

from __future__ import annotations

import base64
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_harness import PLAIN_SCRIPT, PLAIN_TEXT, Process, engine_process, free_port
from tests.multimodal_images import data_url, declared_png, encode, noise_image, write_qwen2_5_vl_bundle
from tests.shared_paths import QWEN3_FIXTURE_DIR
from token_engine.models.random_model import write_random_model

IMAGE_PAD = 151655
# Three images of different sizes and formats: 4, 16 and 6 placeholder tokens (28 px cells, 2 x 2 per token)
FILES = [encode(noise_image(56, 56, seed=1), "PNG"), encode(noise_image(112, 112, seed=2), "JPEG"),
         encode(noise_image(84, 56, seed=3), "WEBP")]
MIMES = ["image/png", "image/jpeg", "image/webp"]


def _chat_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": data_url(FILES[0])}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": {"url": data_url(FILES[1], MIMES[1])}},
        ]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(FILES[2], MIMES[2])}},
                                     {"type": "text", "text": "And this one?"}]},
    ]


def _anthropic_image(index: int) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": MIMES[index],
                                        "data": base64.b64encode(FILES[index]).decode()}}


def _messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": "vl", "max_tokens": 16, "system": "You describe pictures.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, _anthropic_image(0),
                                     {"type": "text", "text": " with "}, _anthropic_image(1)]},
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [_anthropic_image(2), {"type": "text", "text": "And this one?"}]},
    ], **extra}


def _responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": "vl", "instructions": "You describe pictures.", "max_output_tokens": 16, "store": False,
            "input": [
                {"role": "user", "content": [
                    {"type": "input_text", "text": "Compare "},
                    {"type": "input_image", "image_url": data_url(FILES[0])},
                    {"type": "input_text", "text": " with "},
                    {"type": "input_image", "image_url": data_url(FILES[1], MIMES[1])}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "They differ."}]},
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(FILES[2], MIMES[2])},
                                             {"type": "input_text", "text": "And this one?"}]}],
            **extra}


# What a prefill engine's response hands decode (the gateway passes it on and reads nothing else of it)
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
              "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 1}


class RecordingEngine:
    """A /inference/v1/generate that keeps every request body it gets and answers a streamed request with
    PLAIN_SCRIPT as one token event, then the usage event (prompt tokens counted from the body, as an engine
    does) and [DONE]; a non-streamed one (a P/D prefill) with one token and PREFILL_KV."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                engine.bodies.append(body)
                rid = "generate-tokens-" + str(body.get("request_id"))
                prompt = len(body["token_ids"])
                if not body.get("stream"):
                    whole = json.dumps({"request_id": rid, "kv_transfer_params": PREFILL_KV, "choices": [
                        {"index": 0, "token_ids": PLAIN_SCRIPT[:1], "finish_reason": "length"}]}).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(whole)))
                    self.end_headers()
                    self.wfile.write(whole)
                    return
                events = [
                    {"request_id": rid, "choices": [{"index": 0, "token_ids": PLAIN_SCRIPT, "finish_reason": "stop",
                                                      "stop_reason": None}]},
                    {"request_id": rid, "choices": [], "usage": {
                        "prompt_tokens": prompt, "completion_tokens": len(PLAIN_SCRIPT),
                        "total_tokens": prompt + len(PLAIN_SCRIPT)}},
                ]
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for event in [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _gateway(model_dir: Path, engine_url: str, *pools: str) -> Process:
    """A gateway over ``engine_url`` (collocated), or over the ``pools`` flags when given."""
    port = free_port()
    return Process([sys.executable, "-m", "render_service.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                    "--port", str(port), "--served-model-name", "vl", "--image-workers", "1", "--log-level",
                    "warning", *(pools or ("--engine", engine_url))], port)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_5_vl_bundle(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def recording(bundle_dir: Path) -> Iterator[tuple[httpx.Client, RecordingEngine]]:
    engine = RecordingEngine()
    gateway = _gateway(bundle_dir, engine.url)
    try:
        with httpx.Client(base_url=gateway.url, timeout=120) as client:
            yield client, engine
    finally:
        gateway.stop()
        engine.close()


@pytest.fixture(scope="module")
def our_engine(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, str]]:
    """A gateway over our own token engine (a tiny random Qwen3 with the same tokenizer), and the engine's url."""
    model = write_random_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", preset="tiny",
                               tokenizer_dir=QWEN3_FIXTURE_DIR, dtype="float32")
    engine = engine_process(model, max_model_len=512)
    try:
        gateway = _gateway(bundle_dir, engine.url)
        try:
            with httpx.Client(base_url=gateway.url, timeout=120) as client:
                yield client, engine.url
        finally:
            gateway.stop()
    finally:
        engine.stop()


def _sent(engine: RecordingEngine, client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response,
                                                                                                  dict[str, Any]]:
    before = len(engine.bodies)
    r = client.post(path, json=body)
    assert len(engine.bodies) == before + (1 if r.status_code == 200 else 0), r.text
    return r, engine.bodies[-1] if r.status_code == 200 else {}


def _sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_sends_the_engine_the_render_endpoints_ids_and_features(recording) -> None:
    client, engine = recording
    body = {"model": "vl", "messages": _chat_messages(), "max_tokens": 16}
    rendered = client.post("/v1/chat/completions/render", json=body).json()
    r, sent = _sent(engine, client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert sent["token_ids"] == rendered["token_ids"]
    assert sent["features"] == rendered["features"]
    assert [p["length"] for p in sent["features"]["mm_placeholders"]["image"]] == [4, 16, 6]
    assert sent["token_ids"].count(IMAGE_PAD) == 26 and all(sent["features"]["kwargs_data"]["image"])
    assert sent["stream"] is True and sent["sampling_params"]["max_tokens"] == 16
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == PLAIN_TEXT
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])

    streamed, sent = _sent(engine, client, "/v1/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    assert sent["token_ids"] == rendered["token_ids"] and sent["features"] == rendered["features"]
    chunks = _sse_data(streamed.text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == PLAIN_TEXT


def test_messages_and_responses_send_their_render_endpoints_ids_and_features(recording) -> None:
    client, engine = recording
    for path, body in (("/v1/messages", _messages_body()), ("/v1/responses", _responses_body())):
        rendered = client.post(path + "/render", json=body).json()
        for stream in (False, True):
            r, sent = _sent(engine, client, path, {**body, "stream": stream})
            assert r.status_code == 200, r.text
            assert sent["token_ids"] == rendered["token_ids"], path
            assert sent["features"] == rendered["features"], path
            assert PLAIN_TEXT in r.text
    chat = client.post("/v1/chat/completions/render", json={"model": "vl", "messages": _chat_messages()}).json()
    assert engine.bodies[-1]["features"]["mm_hashes"] == chat["features"]["mm_hashes"]  # the same images


def test_disaggregated_prefill_and_decode_both_get_the_ids_and_features(bundle_dir: Path) -> None:
    """P/D: prefill computes the images' encoder output and decode its M-RoPE positions from the grids, so both
    legs carry the rendered ids and features; decode's kv_transfer_params name the same prompt."""
    prefill, decode = RecordingEngine(), RecordingEngine()
    gateway = _gateway(bundle_dir, "", "--prefill", prefill.url, "--decode", decode.url)
    try:
        with httpx.Client(base_url=gateway.url, timeout=120) as client:
            body = {"model": "vl", "messages": _chat_messages(), "max_tokens": 16}
            rendered = client.post("/v1/chat/completions/render", json=body).json()
            r = client.post("/v1/chat/completions", json=body)
    finally:
        gateway.stop()
        prefill.close()
        decode.close()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == PLAIN_TEXT
    ((first,), (second,)) = prefill.bodies, decode.bodies
    for sent in (first, second):
        assert sent["token_ids"] == rendered["token_ids"] and sent["features"] == rendered["features"]
    assert first["stream"] is False and first["sampling_params"]["max_tokens"] == 1
    assert second["kv_transfer_params"] == {**PREFILL_KV, "prompt_token_ids": rendered["token_ids"]}


def test_text_requests_send_no_features(recording) -> None:
    client, engine = recording
    user = [{"role": "user", "content": "a picture of an image"}]
    for path, body in (("/v1/chat/completions", {"model": "vl", "messages": user, "max_tokens": 8}),
                       ("/v1/messages", {"model": "vl", "messages": user, "max_tokens": 8}),
                       ("/v1/responses", {"model": "vl", "input": "an image", "store": False})):
        r, sent = _sent(engine, client, path, body)
        assert r.status_code == 200 and PLAIN_TEXT in r.text, r.text
        assert sent["features"] is None and IMAGE_PAD not in sent["token_ids"]
        assert sent["token_ids"] == client.post(path + "/render", json=body).json()["token_ids"]


def test_a_stored_responses_conversation_sends_its_images_again(recording) -> None:
    client, engine = recording
    first = client.post("/v1/responses", json=_responses_body(store=True))
    assert first.status_code == 200, first.text
    follow = {"model": "vl", "previous_response_id": first.json()["id"], "max_output_tokens": 8,
              "input": "And all three together?"}
    r, sent = _sent(engine, client, "/v1/responses", follow)
    assert r.status_code == 200, r.text
    assert sent["features"]["mm_hashes"] == engine.bodies[-2]["features"]["mm_hashes"]
    assert len(sent["token_ids"]) > len(engine.bodies[-2]["token_ids"])


def test_bad_image_requests_are_4xx_in_each_apis_shape_and_reach_no_engine(recording) -> None:
    client, engine = recording
    before = len(engine.bodies)
    bomb = {"type": "image_url", "image_url": {"url": data_url(declared_png(30000, 30000))}}
    r = client.post("/v1/chat/completions", json={"model": "vl", "messages": [{"role": "user", "content": [bomb]}]})
    assert r.status_code == 400 and "declares" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "vl", "mm_payload": "none", "messages": _chat_messages()})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mm_payload"
    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!!"}}
    r = client.post("/v1/messages", json={"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": [broken]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "base64" in r.json()["error"]["message"]
    r = client.post("/v1/responses", json={"model": "vl", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://127.0.0.1:9/cat.png"}]}]})
    assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "vl", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(FILES[0])}}]}],
        "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert len(engine.bodies) == before
    assert client.get("/health").status_code == 200


def test_our_text_engine_refuses_features_as_a_400_in_each_apis_shape(our_engine) -> None:
    client, _ = our_engine
    chat = {"model": "vl", "messages": _chat_messages(), "max_tokens": 8}
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={**chat, "stream": stream})
        assert r.status_code == 400, r.text
        assert "serves text models" in r.json()["error"]["message"] and r.json()["error"]["param"] == "features"
        r = client.post("/v1/messages", json=_messages_body(stream=stream))
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert "serves text models" in r.json()["error"]["message"]
        r = client.post("/v1/responses", json=_responses_body(stream=stream))
        assert r.status_code == 400, r.text
        assert "serves text models" in r.json()["error"]["message"]
    text = client.post("/v1/chat/completions", json={"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": "no picture here"}]})
    assert text.status_code == 200, text.text  # the same engine serves text requests


def test_count_tokens_counts_image_placeholders_as_the_render_does(our_engine) -> None:
    client, _ = our_engine
    body = _messages_body()
    rendered = client.post("/v1/messages/render", json=body).json()
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"input_tokens": len(rendered["token_ids"])}
    assert rendered["token_ids"].count(IMAGE_PAD) == 26
    one = {"model": "vl", "messages": [{"role": "user", "content": [_anthropic_image(1), {"type": "text",
                                                                                           "text": "?"}]}]}
    assert client.post("/v1/messages/count_tokens", json=one).json()["input_tokens"] == len(
        client.post("/v1/messages/render", json={**one, "max_tokens": 4}).json()["token_ids"])
    bomb = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(declared_png(30000, 30000)).decode()}}
    r = client.post("/v1/messages/count_tokens", json={"model": "vl", "messages": [
        {"role": "user", "content": [bomb]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "declares" in r.json()["error"]["message"]
    r = client.post("/v1/messages/count_tokens", json={"model": "vl", "messages": [
        {"role": "assistant", "content": [_anthropic_image(0)]}]})
    assert r.status_code == 400 and "only supported in user messages" in r.json()["error"]["message"]


def test_a_text_model_gateway_refuses_images_naming_the_covered_families(our_engine) -> None:
    _, engine_url = our_engine
    gateway = _gateway(QWEN3_FIXTURE_DIR, engine_url)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            for stream in (False, True):
                r = client.post("/v1/chat/completions", json={"model": "vl", "messages": _chat_messages(),
                                                              "stream": stream})
                assert r.status_code == 400 and "Qwen2.5-VL" in r.json()["error"]["message"], r.text
                r = client.post("/v1/messages", json=_messages_body(stream=stream))
                assert r.status_code == 400 and r.json()["type"] == "error", r.text
                assert "Qwen2.5-VL" in r.json()["error"]["message"]
                r = client.post("/v1/responses", json=_responses_body(stream=stream))
                assert r.status_code == 400 and "Qwen2.5-VL" in r.json()["error"]["message"], r.text
            r = client.post("/v1/messages/count_tokens", json={"model": "vl", "messages": _messages_body()["messages"]})
            assert r.status_code == 400 and "Qwen2.5-VL" in r.json()["error"]["message"], r.text
            assert client.post("/v1/messages/count_tokens", json={"model": "vl", "messages": [
                {"role": "user", "content": "an image of a cat"}]}).status_code == 200
    finally:
        gateway.stop()
