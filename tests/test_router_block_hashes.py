"""A router shaped like llm-d's precise prefix scorer, over real servers: render (with block hashes) -> score the
engines by the blocks each already holds -> generate on the best one. The ids render produced are the ids the
engine computed, and a conversation's next turn lands where its prefix is cached."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.gateway_harness import Process, free_port, write_scripted_qwen3

BLOCK = 4  # the engines' --block-size in the harness


class PrefixRouter:
    """Which engine holds which blocks, learned from the hashes render hands out (llm-d learns them from KV
    events; the hashes are the same values)."""

    def __init__(self, engines: list[str]) -> None:
        self.held: dict[str, set[int]] = {url: set() for url in engines}

    def leading_hits(self, url: str, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held[url]:
            n += 1
        return n

    def pick(self, hashes: list[int]) -> str:
        return max(self.held, key=lambda url: (self.leading_hits(url, hashes), -len(self.held[url])))

    def served(self, url: str, hashes: list[int]) -> None:
        self.held[url].update(hashes)


def engine(model) -> Process:
    port = free_port()
    return Process([sys.executable, "-m", "token_engine.cli", "serve", str(model), "--host", "127.0.0.1", "--port",
                    str(port), "--dtype", "float32", "--max-model-len", "256", "--block-size", str(BLOCK),
                    "--num-gpu-blocks-override", "256", "--enable-prompt-tokens-details", "--served-model-name", "tiny",
                    "--log-level", "warning"],
                   port, wait=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = write_scripted_qwen3(tmp_path_factory.mktemp("router") / "tiny")
    engines = [engine(model), engine(model)]
    port = free_port()
    render = Process([sys.executable, "-m", "render_service.cli", "serve", str(model), "--host", "127.0.0.1", "--port",
                      str(port), "--served-model-name", "tiny", "--block-size", str(BLOCK), "--log-level",
                      "warning"], port, wait=False)
    try:
        for p in [*engines, render]:
            p.wait_healthy()
        yield render, engines
    finally:
        for p in [render, *engines]:
            p.stop()


def test_render_hash_route_generate_sees_the_same_ids_and_reuses_the_prefix(stack):
    render, engines = stack
    router = PrefixRouter([e.url for e in engines])
    messages = [{"role": "user", "content": "Plan a three-day trip to Kyoto with temples and food."}]
    picked = []
    with httpx.Client(timeout=120) as client:
        for turn in range(3):
            rendered = client.post(render.url + "/v1/chat/completions/render", json={
                "model": "tiny", "messages": messages, "max_tokens": 6, "return_block_hashes": True,
                "chat_template_kwargs": {"enable_thinking": False}}).json()
            hashes = rendered.pop("block_hashes")
            assert len(hashes) == len(rendered["token_ids"]) // BLOCK
            url = router.pick(hashes)
            picked.append(url)
            predicted = router.leading_hits(url, hashes)
            generated = client.post(url + "/inference/v1/generate", json={
                **rendered, "stream": False, "return_token_ids": True}).json()
            assert generated.get("prompt_token_ids") == rendered["token_ids"], generated  # the ids render produced
            router.served(url, hashes)
            if turn:  # the blocks the router expected on that engine were there: its prefix cache served them
                assert predicted > 0
                assert generated["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK * predicted
            out = generated["choices"][0]["token_ids"]
            messages = messages + [{"role": "assistant", "content": f"(sampled {len(out)} tokens)"},
                                   {"role": "user", "content": f"And day {turn + 2}?"}]
    assert picked[1] == picked[0] and picked[2] == picked[0]  # the conversation stays where its prefix is
